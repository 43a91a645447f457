// Gated MLA block (K3-ARCHITECTURE.md §5.4), NoPE. New rows' [latent | k_rot] are appended to
// each sequence's cache; attention then reads the cache, either expanded through kv_b (the
// reference's form, cheaper when most of the cache is new) or with absorbed weights (decode).
#include <cmath>
#include <cstring>

#include "core/parallel.h"
#include "kernels/ffn/glu.h"
#include "kernels/mla/mla.h"
#include "kernels/norm/norm.h"
#include "model/layers.h"

namespace k3 {

void mla_attention_forward(float* out, const float* x, int64_t N, const std::vector<Segment>& segs, int64_t layer,
                           const MlaWeights& w, const K3Config& c, const PathOptions& opt) {
  const mla::Dims d{c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank};
  const int64_t H = d.H, dq = d.Dn + d.Dr, dkv = d.Dn + d.Dv, ldc = d.R + d.Dr;
  const double scale = 1.0 / std::sqrt(double(dq));

  std::vector<float> q(size_t(N * H * dq));  // [N, H*(Dn+Dr)]
  if (!w.q_a_proj.empty()) {
    std::vector<float> qa(size_t(N * c.q_lora_rank));
    linear_forward(qa.data(), x, N, w.q_a_proj);  // [N, q_lora]
    opt.bf16(qa);
    rmsnorm_forward(qa.data(), qa.data(), w.q_a_layernorm.data(), c.mla_norm_eps, N, c.q_lora_rank);
    opt.bf16(qa);
    linear_forward(q.data(), qa.data(), N, w.q_b_proj);
  } else {
    linear_forward(q.data(), x, N, w.q_proj);
  }
  opt.bf16(q);
  std::vector<float> ckv(size_t(N * ldc));
  linear_forward(ckv.data(), x, N, w.kv_a_proj_with_mqa);                                         // [N, R + Dr]
  rmsnorm_forward(ckv.data(), ckv.data(), w.kv_a_layernorm.data(), c.mla_norm_eps, N, d.R, ldc);  // latent only
  opt.bf16(ckv);  // the GPU's cache rows are bf16

  std::vector<float> o(size_t(N * H * d.Dv));  // [N, H*Dv]
  for (const Segment& s : segs) {
    MlaLayerCache& lc = s.cache->mla[size_t(layer)];
    const int64_t p0 = int64_t(lc.rows.size()) / ldc, T = p0 + s.n;
    lc.rows.insert(lc.rows.end(), ckv.begin() + s.row0 * ldc, ckv.begin() + (s.row0 + s.n) * ldc);
    const float* qs = q.data() + s.row0 * H * dq;
    float* os = o.data() + s.row0 * H * d.Dv;
    // Cost per query token: expanded needs kv_b over all T cache rows once (T*H*dkv*R) plus
    // T*H*(dq+Dv); absorbed needs per query H*R*(Dn+Dv) for the absorption plus T*H*(R+Dr+R).
    const bool expanded = opt.reference || s.n * 4 >= T;
    if (expanded) {
      std::vector<double> lat(size_t(T * d.R)), kvh(size_t(T * dkv));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < d.R; ++j) lat[size_t(t * d.R + j)] = lc.rows[size_t(t * ldc + j)];
      for (int64_t h = 0; h < H; ++h) {
        linear_forward_f64(kvh.data(), lat.data(), T, w.kv_b_proj.row_slice(h * dkv, dkv));  // [T, Dn+Dv]
        opt.bf16(kvh);
        mla::attention_head_expanded(os + h * d.Dv, H * d.Dv, qs + h * dq, H * dq, kvh.data(), lc.rows.data(), ldc, s.n,
                                     p0, d, scale);
      }
    } else {
      const int64_t nR = s.n * d.R;
      std::vector<double> qlat(size_t(H * nR)), olat(size_t(H * nR)), qn(size_t(s.n * d.Dn)), vh(size_t(s.n * d.Dv));
      for (int64_t h = 0; h < H; ++h) {  // q_lat_h = q_nope_h · W_kb_h   [n, R]
        for (int64_t i = 0; i < s.n; ++i)
          for (int64_t j = 0; j < d.Dn; ++j) qn[size_t(i * d.Dn + j)] = qs[i * H * dq + h * dq + j];
        linear_transposed_forward_f64(&qlat[size_t(h * nR)], qn.data(), s.n, w.kv_b_proj.row_slice(h * dkv, d.Dn));
      }
      opt.bf16(qlat);
      parallel_for_dynamic(H, H * s.n * (p0 + s.n) * d.R, [&](int64_t h) {
        mla::attention_head_latent(&olat[size_t(h * nR)], &qlat[size_t(h * nR)], qs + h * dq, H * dq, lc.rows.data(),
                                   ldc, s.n, p0, d, scale);
      });
      opt.bf16(olat);                    // the latent output is fp32 in the kernel, bf16 into the W_vb product
      for (int64_t h = 0; h < H; ++h) {  // v_h = W_vb_h · o_lat_h   [n, Dv]
        linear_forward_f64(vh.data(), &olat[size_t(h * nR)], s.n, w.kv_b_proj.row_slice(h * dkv + d.Dn, d.Dv));
        for (int64_t i = 0; i < s.n; ++i)
          for (int64_t j = 0; j < d.Dv; ++j) os[i * H * d.Dv + h * d.Dv + j] = float(vh[size_t(i * d.Dv + j)]);
      }
    }
  }
  opt.bf16(o);
  if (!w.g_proj.empty()) {
    std::vector<float> gate(size_t(N * H * d.Dv));
    linear_forward(gate.data(), x, N, w.g_proj);
    opt.bf16(gate);
    for (size_t i = 0; i < o.size(); ++i) o[i] *= sigmoidf_stable(gate[i]);
    opt.bf16(o);
  }
  linear_forward(out, o.data(), N, w.o_proj);
}

}  // namespace k3
