// Gated MLA block (K3-ARCHITECTURE.md §5.4), NoPE. New rows' [latent | k_rot] are appended to
// each sequence's cache; attention then reads the cache, either expanded through kv_b (the
// reference's form, cheaper when most of the cache is new) or with absorbed weights (decode).
#include <cmath>
#include <cstring>

#include "kernels/ffn/glu.h"
#include "kernels/mla/mla.h"
#include "kernels/norm/norm.h"
#include "model/layers.h"

namespace k3 {

void mla_attention_forward(float* out, const float* x, int64_t N, const std::vector<Segment>& segs, int64_t layer,
                           const MlaWeights& w, const K3Config& c, const PathOptions& opt) {
  const mla::Dims d{c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank};
  const int64_t H = d.H, dq = d.Dn + d.Dr, dkv = d.Dn + d.Dv, ldc = d.R + d.Dr;
  const float scale = 1.0f / std::sqrt(float(dq));

  std::vector<float> q(size_t(N * H * dq));  // [N, H*(Dn+Dr)]
  if (!w.q_a_proj.empty()) {
    std::vector<float> qa(size_t(N * c.q_lora_rank));
    linear_forward(qa.data(), x, N, w.q_a_proj);  // [N, q_lora]
    rmsnorm_forward(qa.data(), qa.data(), w.q_a_layernorm.data(), c.mla_norm_eps, N, c.q_lora_rank);
    linear_forward(q.data(), qa.data(), N, w.q_b_proj);
  } else {
    linear_forward(q.data(), x, N, w.q_proj);
  }
  std::vector<float> ckv(size_t(N * ldc));
  linear_forward(ckv.data(), x, N, w.kv_a_proj_with_mqa);  // [N, R + Dr]
  rmsnorm_forward(ckv.data(), ckv.data(), w.kv_a_layernorm.data(), c.mla_norm_eps, N, d.R, ldc);  // latent only

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
      std::vector<float> lat(size_t(T * d.R)), kv(size_t(T * H * dkv));
      for (int64_t t = 0; t < T; ++t) std::memcpy(&lat[size_t(t * d.R)], &lc.rows[size_t(t * ldc)], size_t(d.R) * 4);
      linear_forward(kv.data(), lat.data(), T, w.kv_b_proj);  // [T, H*(Dn+Dv)]
      mla::attention_expanded(os, qs, kv.data(), lc.rows.data(), ldc, s.n, p0, d, scale);
    } else {
      std::vector<float> qn(size_t(s.n * d.Dn)), qlat(size_t(s.n * H * d.R)), olat(size_t(s.n * H * d.R));
      for (int64_t h = 0; h < H; ++h) {
        const WeightRef kb = w.kv_b_proj.row_slice(h * dkv, d.Dn);  // [Dn, R]
        for (int64_t i = 0; i < s.n; ++i) std::memcpy(&qn[size_t(i * d.Dn)], qs + i * H * dq + h * dq, size_t(d.Dn) * 4);
        std::vector<float> qh(size_t(s.n * d.R));
        linear_transposed_forward(qh.data(), qn.data(), s.n, kb);  // q_lat_h = q_nope_h · W_kb_h  [n, R]
        for (int64_t i = 0; i < s.n; ++i) std::memcpy(&qlat[size_t((i * H + h) * d.R)], &qh[size_t(i * d.R)], size_t(d.R) * 4);
      }
      mla::attention_latent(olat.data(), qlat.data(), qs, lc.rows.data(), ldc, s.n, p0, d, scale);
      for (int64_t h = 0; h < H; ++h) {
        const WeightRef vb = w.kv_b_proj.row_slice(h * dkv + d.Dn, d.Dv);  // [Dv, R]
        linear_forward(os + h * d.Dv, H * d.Dv, olat.data() + h * d.R, H * d.R, s.n, vb);
      }
    }
  }
  if (!w.g_proj.empty()) {
    std::vector<float> gate(size_t(N * H * d.Dv));
    linear_forward(gate.data(), x, N, w.g_proj);
    for (size_t i = 0; i < o.size(); ++i) o[i] *= sigmoidf_stable(gate[i]);
  }
  linear_forward(out, o.data(), N, w.o_proj);
}

}  // namespace k3
