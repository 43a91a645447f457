// Gated MLA attention cores on the GPU (sm_90a, H100/H200): the CUDA twin of kernels/mla/mla.h.
// K3-ARCHITECTURE.md §5.4. Plain C++: no CUDA headers; every pointer here is a device pointer and
// every launch goes to the default stream.
//
// Dimension letters as in mla.h: B sequences; n new query tokens at positions p0..p0+n-1 of each
// sequence; T = p0 + n cached positions; H heads; Dn = qk_nope, Dr = qk_rope (never rotated: NoPE),
// Dv = v_head_dim, R = kv_lora_rank. Scores are (q_nope·k_nope + q_rot·k_rot) * scale with
// scale = 1/sqrt(Dn + Dr) (1/sqrt(192) for K3, not 1/sqrt(128)); causal (query at position p sees
// keys 0..p); softmax in fp32 with a running max (flash style), exp2 with log2(e)*scale folded in.
//
//   prefill: the expanded form (bf16 q, k, v; tensor cores mma.sync m16n8k16, fp32 accumulate).
//            Compare with mla::attention_head_expanded.
//   decode:  the absorbed form: q_lat = W_kbᵀ q_nope (per head, R wide) and q_rot score against the
//            cache rows [latent (R) | k_rot (Dr)] directly; the output is the latent Σ p·latent [R]
//            in fp32, which the caller expands with W_vb. All heads of a token share the cache
//            rows, so the kernel runs (token, head) rows as one 64-row tensor-core tile (MQA form),
//            split over T (flash-decoding) with a combine pass when the cache is long.
//            Compare with mla::attention_head_latent.
//
// Shapes the kernels take (anything else is a k3::Error naming the argument):
//   prefill: Dn+Dr and Dv multiples of 16, Dn+Dr <= 256, Dv <= 128. K3 (192, 128) has its own
//            exact instantiation; other dims run in the smallest bucket (64,64) (128,128) (256,128)
//            that holds them.
//   decode:  R and Dr multiples of 16, R <= 512, Dr <= 64; K3 (512, 64) exact, others in the
//            (128, 64) or (512, 64) bucket. Cache rows 16-byte aligned (ldc % 8 == 0).
//   all:     base pointers 16-byte aligned.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"       // defines: k3::fail (the no-CUDA stubs)
#include "kernels/mla/mla.h"  // defines: mla::Dims

namespace k3::mla::cuda {

enum class Dtype { BF16, F32 };

struct PrefillParams {
  const uint16_t* q = nullptr;  // [B, n, H, Dn+Dr] bf16: per head [q_nope | q_rot]
  const uint16_t* k = nullptr;  // [B, T, H, Dn+Dr] bf16: per head [k_nope | k_rot] (k_rot repeated per head)
  const uint16_t* v = nullptr;  // [B, T, H, Dv] bf16
  void* o = nullptr;            // [B, n, H, Dv], o_type
  Dtype o_type = Dtype::F32;
  Dims d{};                      // H, Dn, Dr, Dv used (R ignored)
  int64_t B = 1, n = 0, p0 = 0;  // T = p0 + n
};

struct DecodeParams {
  const void* q_lat = nullptr;  // [B, n, H, R] q_type: W_kb_hᵀ q_nope per head
  const void* q_rot = nullptr;  // [B, n, H, Dr] q_type
  Dtype q_type = Dtype::F32;
  const uint16_t* cache = nullptr;  // [B] x [T, ldc] bf16 rows [latent (R) | k_rot (Dr) | unused]
  int64_t ldc = 0;                  // elements between cache rows (>= R + Dr, multiple of 8)
  int64_t cache_stride_b = 0;       // elements between sequences' caches; 0 means T * ldc
  float* o_lat = nullptr;           // [B, n, H, R] fp32: Σ_s p(s) latent(s)
  Dims d{};                         // H, Dr, R used; Dn only for the scale 1/sqrt(Dn + Dr)
  int64_t B = 1, n = 1, p0 = 0;     // n new tokens per sequence at positions p0..p0+n-1; T = p0 + n
  int num_splits = 0;               // split-K over T: 0 = choose from the SM count and T
  int64_t split_keys = 0;           // > 0: splits of this many keys (rounded up to 32), whatever B and the SMs
  // Per-sequence lengths and rows (device [B] each, both or neither; cache is then unused): sequence b has cached
  // seq_p0[b] <= p0 tokens in the rows at seq_cache[b]; p0 is then the largest, for the planning.
  const int32_t* seq_p0 = nullptr;
  const uint16_t* const* seq_cache = nullptr;
  void* workspace = nullptr;        // device scratch of decode_workspace_bytes(*this) bytes (when > 0)
  size_t workspace_bytes = 0;
};

// The exact path (the GPU model's fp32 parity mode): the expanded form in fp64, the twin of
// mla::attention_head_expanded for all heads at once. Scores, softmax and sums are fp64 as on the CPU;
// the only difference is the order of the softmax (online, over tiles of keys, rather than two passes),
// which changes fp64 roundings only. One CTA per (query, head); not a fast kernel.
struct ExactParams {
  float* o = nullptr;            // [n, H, Dv] fp32
  const float* q = nullptr;      // [n, H, Dn+Dr] fp32: per head [q_nope | q_rot]
  const double* kvh = nullptr;   // [T, H, Dn+Dv] fp64: per head [k_nope | v] (kv_b applied to the cached latents)
  const float* cache = nullptr;  // [T, ldc] fp32 cache rows: k_rot at columns R..R+Dr
  int64_t ldc = 0;
  Dims d{};
  int64_t n = 0, p0 = 0;  // T = p0 + n
};

#ifdef K3_HAVE_CUDA
// "" when the exact kernel takes p (Dv <= 1024, Dn + Dr <= 4096), else the reason.
std::string can_run(const ExactParams& p);
void attention_expanded_exact(const ExactParams& p);

// "" when the prefill kernel takes these params, else the reason (names the argument).
std::string can_run(const PrefillParams& p);
// o <- causal softmax attention. Throws k3::Error when can_run says no.
void prefill(const PrefillParams& p);

// "" when the decode kernel takes these params (workspace not considered), else the reason.
std::string can_run(const DecodeParams& p);
// The number of T splits decode will use (p.num_splits when > 0, else chosen from the device).
int decode_splits(const DecodeParams& p);
// Scratch that decode needs for these params: 0 with one split, else the partial outputs.
size_t decode_workspace_bytes(const DecodeParams& p);
// o_lat <- causal softmax over the cache of [q_lat | q_rot]·[latent | k_rot], applied to the latent.
// Throws k3::Error when can_run says no or the workspace is missing or too small.
void decode(const DecodeParams& p);

// One new cache row per sequence, for a decode step over sequences whose rows live apart: row seq_p0[b] of the
// rows at seq_rows[b] (ldc elements apart) <- src[b] (fp32 [B, width], rounded to bf16 to nearest even, as
// elementwise::cuda::copy_rows). seq_rows, seq_p0: device [B].
void append_rows(uint16_t* const* seq_rows, int64_t ldc, const int32_t* seq_p0, const float* src, int64_t width,
                 int64_t B);

#else  // a build without the CUDA backend: every entry point says so
inline std::string can_run(const ExactParams&) { return "this build has no CUDA backend"; }
inline void attention_expanded_exact(const ExactParams&) {
  fail("mla::cuda::attention_expanded_exact: this build has no CUDA backend");
}
inline std::string can_run(const PrefillParams&) { return "this build has no CUDA backend"; }
inline std::string can_run(const DecodeParams&) { return "this build has no CUDA backend"; }
inline void prefill(const PrefillParams&) { fail("mla::cuda::prefill: this build has no CUDA backend"); }
inline int decode_splits(const DecodeParams&) { fail("mla::cuda::decode_splits: this build has no CUDA backend"); }
inline size_t decode_workspace_bytes(const DecodeParams&) {
  fail("mla::cuda::decode_workspace_bytes: this build has no CUDA backend");
}
inline void decode(const DecodeParams&) { fail("mla::cuda::decode: this build has no CUDA backend"); }
inline void append_rows(uint16_t* const*, int64_t, const int32_t*, const float*, int64_t, int64_t) {
  fail("mla::cuda::append_rows: this build has no CUDA backend");
}
#endif

}  // namespace k3::mla::cuda
