// Gated MLA attention cores (NoPE), CPU. K3-ARCHITECTURE.md §5.4.
//
// Dimension letters: n new query tokens at positions p0..p0+n-1 of a sequence whose cache holds
// T = p0 + n positions; H heads; Dn = qk_nope_head_dim; Dr = qk_rope_head_dim (never rotated);
// Dv = v_head_dim; R = kv_lora_rank. Scores are (q_nope·k_nope + q_rot·k_rot) * scale with
// scale = 1/sqrt(Dn + Dr); causal; max-subtracted softmax.
//
// Two forms of the same math, one head at a time:
//   expanded: keys/values of the head from kv_b(latent), kvh [T, Dn+Dv] — the reference's form; prefill.
//   latent:   weights absorbed — q_lat = W_kbᵀ q_nope scores against the 576-wide cache rows
//             [latent | k_rot] directly, and the latent output is expanded by W_vb afterwards; decode.
// Both keep scores, probabilities and sums in fp64 (inputs that differ between the forms, kvh and
// q_lat, are fp64 too), so they agree to the final fp32 rounding: cached decoding (latent) and a
// full recomputation (expanded) give the same logits (docs/NUMERICS.md).
#pragma once
#include <cstdint>

namespace k3::mla {

struct Dims {
  int64_t H, Dn, Dr, Dv, R;
};

// out [n, Dv] rows of stride ldo: head h's output. q: row i of head h starts at q + i*ldq
// ([q_nope (Dn) | q_rot (Dr)]). kvh [T, Dn+Dv] fp64: [k_nope | v] of this head per position.
// cache [T, ldc]: k_rot at columns R..R+Dr of each row.
void attention_head_expanded(float* out, int64_t ldo, const float* q, int64_t ldq, const double* kvh,
                             const float* cache, int64_t ldc, int64_t n, int64_t p0, const Dims& d, double scale);

// out_lat [n, R] fp64: Σ_s p(s) latent(s) for head h. q_lat [n, R] fp64. q as above (only q_rot read).
// cache [T, ldc] rows = [latent (R) | k_rot (Dr) ...].
void attention_head_latent(double* out_lat, const double* q_lat, const float* q, int64_t ldq, const float* cache,
                           int64_t ldc, int64_t n, int64_t p0, const Dims& d, double scale);

}  // namespace k3::mla
