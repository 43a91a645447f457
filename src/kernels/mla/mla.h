// Gated MLA attention cores (NoPE), CPU fp32. K3-ARCHITECTURE.md §5.4.
//
// Dimension letters: n new query tokens at positions p0..p0+n-1 of a sequence whose cache holds
// T = p0 + n positions; H heads; Dn = qk_nope_head_dim; Dr = qk_rope_head_dim (never rotated);
// Dv = v_head_dim; R = kv_lora_rank. Scores are (q_nope·k_nope + q_rot·k_rot) * scale with
// scale = 1/sqrt(Dn + Dr); causal; softmax in fp32 (max-subtracted).
//
// Two forms of the same math:
//   expanded: keys/values per head from kv_b(latent) — what the reference computes; prefill.
//   latent:   weights absorbed — q_nope is mapped into the latent space once per query
//             (q_lat_h = W_kbᵀ_h q_nope_h), scores read the 576-wide cache [latent | k_rot]
//             directly, and the latent output is expanded by W_vb_h afterwards; decode.
#pragma once
#include <cstdint>

namespace k3::mla {

struct Dims {
  int64_t H, Dn, Dr, Dv, R;
};

// out [n, H*Dv]; q [n, H*(Dn+Dr)]; kv [T, H*(Dn+Dv)] (per head: k_nope | v);
// cache [T, ldc] with k_rot at columns R..R+Dr of each row (ldc >= R + Dr).
void attention_expanded(float* out, const float* q, const float* kv, const float* cache, int64_t ldc, int64_t n,
                        int64_t p0, const Dims& d, float scale);

// out_lat [n, H*R]; q_lat [n, H*R]; q [n, H*(Dn+Dr)] (only the rot part is read);
// cache [T, ldc] rows = [latent (R) | k_rot (Dr) ...].
void attention_latent(float* out_lat, const float* q_lat, const float* q, const float* cache, int64_t ldc, int64_t n,
                      int64_t p0, const Dims& d, float scale);

}  // namespace k3::mla
