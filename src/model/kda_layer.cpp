// KDA attention block (K3-ARCHITECTURE.md §5.3): projections, short conv + SiLU, q/k L2 norm,
// beta, lower-bounded gate, delta-rule state update, per-head gated RMSNorm, output projection.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/ffn/glu.h"
#include "kernels/kda/kda.h"
#include "model/layers.h"

namespace k3 {

PathOptions PathOptions::from_env() {
  PathOptions o;
  const char* r = std::getenv("K3_REFERENCE");
  o.reference = r && *r && std::strcmp(r, "0") != 0;
  return o;
}

void kda_attention_forward(float* out, const float* x, int64_t N, const std::vector<Segment>& segs, int64_t layer,
                           const KdaWeights& w, const K3Config& c, const PathOptions& opt) {
  const int64_t H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, K = c.short_conv_kernel_size;
  std::vector<float> qp(size_t(N * HD)), kp(size_t(N * HD)), vp(size_t(N * HD));
  linear_forward(qp.data(), x, N, w.q_proj);  // [N, HD]
  linear_forward(kp.data(), x, N, w.k_proj);  // [N, HD]
  linear_forward(vp.data(), x, N, w.v_proj);  // [N, HD]
  opt.bf16(qp), opt.bf16(kp), opt.bf16(vp);

  std::vector<float> q(size_t(N * HD)), k(size_t(N * HD)), v(size_t(N * HD));
  for (const Segment& s : segs) {
    KdaLayerCache& lc = s.cache->kda[size_t(layer)];
    const int64_t o = s.row0 * HD;
    kda::short_conv_silu_forward(q.data() + o, qp.data() + o, s.n, HD, w.q_conv.data(), int(K), lc.q_tail.data());
    kda::short_conv_silu_forward(k.data() + o, kp.data() + o, s.n, HD, w.k_conv.data(), int(K), lc.k_tail.data());
    kda::short_conv_silu_forward(v.data() + o, vp.data() + o, s.n, HD, w.v_conv.data(), int(K), lc.v_tail.data());
  }
  opt.bf16(q), opt.bf16(k), opt.bf16(v);
  kda::l2norm_heads(q.data(), N, H, D, 1e-6f);
  kda::l2norm_heads(k.data(), N, H, D, 1e-6f);
  opt.bf16(q), opt.bf16(k);

  std::vector<float> beta(size_t(N * H));
  linear_forward(beta.data(), x, N, w.b_proj);  // [N, H]
  for (float& b : beta) b = sigmoidf_stable(b);

  std::vector<float> fa(size_t(N * D)), g(size_t(N * HD));
  linear_forward(fa.data(), x, N, w.f_a_proj);          // [N, D]
  opt.bf16(fa);                                         // (z stays fp32 on the GPU too)
  linear_forward(qp.data(), fa.data(), N, w.f_b_proj);  // z: [N, HD] (reuses qp)
  kda::gate_forward(g.data(), qp.data(), w.A_log.data(), w.dt_bias.data(), c.gate_lower_bound, N, H, D);

  // The recurrence is the specification and the cheapest form for a handful of tokens (decode);
  // the chunked form is the prefill path. Both are tested equal (tests/test_kda.cpp).
  std::vector<float>& o = kp;  // [N, HD] (reuses kp)
  const float scale = 1.0f / std::sqrt(float(D));
  for (const Segment& s : segs) {
    KdaLayerCache& lc = s.cache->kda[size_t(layer)];
    const int64_t r = s.row0;
    const float *qs = q.data() + r * HD, *ks = k.data() + r * HD, *vs = v.data() + r * HD, *gs = g.data() + r * HD;
    if (opt.reference || s.n < 16)
      kda::kda_recurrent_forward(o.data() + r * HD, qs, ks, vs, gs, beta.data() + r * H, scale, lc.state.data(), s.n, H,
                                 D, D);
    else
      kda::kda_chunk_forward(o.data() + r * HD, qs, ks, vs, gs, beta.data() + r * H, scale, lc.state.data(), s.n, H, D,
                             D, opt.kda_chunk);
  }

  opt.bf16(o);
  linear_forward(vp.data(), x, N, w.g_proj);  // output gate pre-activation [N, HD] (reuses vp)
  opt.bf16(vp);
  kda::gated_rmsnorm_forward(o.data(), o.data(), vp.data(), w.o_norm.data(), c.rms_norm_eps, N, H, D);
  opt.bf16(o);
  linear_forward(out, o.data(), N, w.o_proj);  // [N, hidden]
}

}  // namespace k3
