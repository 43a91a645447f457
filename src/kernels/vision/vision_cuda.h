// The vision tower's own ops on the GPU (MoonViT-V2 + PatchMergerMLPV2, K3-ARCHITECTURE.md §8): the CUDA twins
// of kernels/vision/vision.h and of the elementwise steps of model/vision.cpp. The GEMMs and RMSNorms of the
// tower are the text model's (kernels/gemm/linear_cuda.h, kernels/norm/norm_cuda.h); model/cuda/vision_cuda.h
// composes them. Plain C++: no CUDA headers; every pointer is a device pointer, every launch goes to the
// calling thread's default stream. bf16 is uint16_t bits.
//
// Numerics (docs/CUDA.md, "The vision tower on the GPU"):
//   - position embedding: the table resized bilinearly (align_corners = false) and added in double, as the CPU
//     does, one rounding to fp32 (the residual stream stays fp32);
//   - RoPE: cos/sin tabulated once on the host in double (rope_table), the rotation in fp32, one rounding to
//     bf16 into the attention's packed operands;
//   - attention: bf16 q, k, v on tensor cores with fp32 accumulation; scores, running max and sums in fp32
//     (exp2 with log2(e)/sqrt(hd) folded into the scores); P rounded to bf16 for P·V (FlashAttention's choice);
//     the output rounded once to bf16 (the input of the wo GEMM);
//   - GELU in fp32 in forms without cancellation (x·σ(2z) for the tanh form, x·erfc(-x/√2)/2 for the erf form),
//     one rounding to bf16 (the input of the next GEMM);
//   - the merge's mean over frames in double, bit for bit the CPU's, written as fp32 (returned) and bf16 (the
//     projector's GEMM input).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"  // defines: k3::fail (the no-CUDA stubs)

namespace k3::vision::cuda {

// ---- position embedding -----------------------------------------------------------------------------------

// x [t * h * w, D] fp32 (one item's rows, frames outer) += the position table [H0, W0, D] resized to (h, w) as
// k3::position_table_resize does (a copy when the sizes agree), + time[f, :] for frame f when time is not null
// ([t, D] fp32: k3::frame_time_embedding; the CPU adds it for clips only). Each element
// x = fp32(double(x) + double(pos) + double(time)), pos rounded to fp32 from the double interpolation first.
struct PositionParams {
  float* x = nullptr;
  const float* table = nullptr;
  int64_t H0 = 0, W0 = 0, D = 0;
  int64_t t = 1, h = 0, w = 0;
  const float* time = nullptr;  // [t, D] or null
};
#ifdef K3_HAVE_CUDA
std::string can_run(const PositionParams& p);
void add_position_embedding(const PositionParams& p);
#else  // a build without the CUDA backend: the entry points say so
inline std::string can_run(const PositionParams&) { return "this build has no CUDA backend"; }
inline void add_position_embedding(const PositionParams&) {
  fail("vision::cuda::add_position_embedding: this build has no CUDA backend");
}
#endif

// ---- 2D RoPE and the attention's operands -----------------------------------------------------------------

// The padded head width the attention kernels take for head dim hd: 32, 64 or 128 (hd rounded up), 0 when
// hd > 128 (no kernel; a k3::Error names it).
int64_t packed_width(int64_t hd);

// cos and sin of pos · f_i, f_i = 10000^(-4i / hd), for pos < positions and i < hd / 4, in double rounded to
// fp32: [positions][hd / 4][2] (cos, sin). What rope_pack reads (upload it once).
std::vector<float> rope_table(int64_t hd, int64_t positions);

// The rotation of k3::rope2d_forward on q and k, and the packing the attention kernels read:
//   q, k, v [heads][L][W] bf16 (head-major, W = packed_width(hd), columns hd..W-1 zero) from
//   qkv [L, ld] fp32 = [q (heads * hd) | k (heads * hd) | v (heads * hd) | ...] per row.
// Pair 2i of a head vector turns by cols[r] f_i and pair 2i + 1 by rows[r] f_i (the column first), from the
// table; v is copied. Rows and columns must be < positions (the table's).
struct RopePackParams {
  const float* qkv = nullptr;  // [L, ld] fp32
  int64_t ld = 0;
  int64_t L = 0, heads = 0, hd = 0;
  const int32_t* rows = nullptr;  // [L]
  const int32_t* cols = nullptr;  // [L]
  const float* table = nullptr;   // rope_table(hd, positions)
  int64_t positions = 0;
  uint16_t* q = nullptr;  // [heads][L][W]
  uint16_t* k = nullptr;
  uint16_t* v = nullptr;
};
#ifdef K3_HAVE_CUDA
std::string can_run(const RopePackParams& p);
void rope_pack(const RopePackParams& p);
#else  // a build without the CUDA backend: the entry points say so
inline std::string can_run(const RopePackParams&) { return "this build has no CUDA backend"; }
inline void rope_pack(const RopePackParams&) { fail("vision::cuda::rope_pack: this build has no CUDA backend"); }
#endif

// ---- bidirectional attention --------------------------------------------------------------------------------

// Which kernel runs the attention (the benchmark and the tests pick them by name):
//   kMmaSync  FlashAttention-2 on mma.sync m16n8k16: a CTA owns 64 queries of one (item, head), 4 warps of 16
//             rows, 64-key tiles double-buffered by cp.async. Any packed width (32, 64, 128).
//   kWgmma    FlashAttention-3's structure on Hopper's warpgroup MMA (the training attention's forward,
//             kernels/mla/mla_train_wgmma_cuda.cu, without its causal mask): a TMA producer warpgroup, two
//             consumer warpgroups of 64 queries, 128-key tiles in a two-stage ring. Packed width 128 only.
//   kAuto     kWgmma at width 128, else kMmaSync.
enum class AttnKernel { kAuto, kMmaSync, kWgmma };
const char* attn_kernel_name(AttnKernel k);
// "auto", "mma", "wgmma"; anything else is a k3::Error naming `what`.
AttnKernel parse_attn_kernel(const std::string& s, const char* what);

// o = softmax(q kᵀ / sqrt(hd)) v per head over each item's rows, every row seeing every row of its item and
// none of another (the reference's varlen flash attention, causal = False).
struct AttentionParams {
  const uint16_t* q = nullptr;  // [heads][L][W] bf16: rope_pack's output
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  int64_t L = 0, heads = 0, hd = 0;     // W = packed_width(hd)
  const int32_t* cu_seqlens = nullptr;  // [items + 1]: item i is rows [cu[i], cu[i + 1]); cu[0] = 0, cu[items] = L
  int64_t items = 0, max_len = 0;       // max_len >= every item's length
  uint16_t* o = nullptr;                // [L, ldo] bf16: head h at columns [h hd, (h + 1) hd); others untouched
  int64_t ldo = 0;
  AttnKernel kernel = AttnKernel::kAuto;
};
#ifdef K3_HAVE_CUDA
std::string can_run(const AttentionParams& p);
void attention(const AttentionParams& p);
#else  // a build without the CUDA backend: the entry points say so
inline std::string can_run(const AttentionParams&) { return "this build has no CUDA backend"; }
inline void attention(const AttentionParams&) { fail("vision::cuda::attention: this build has no CUDA backend"); }
#endif

// ---- activations, merge -----------------------------------------------------------------------------------

enum class Gelu { kTanh, kErf };  // PyTorch's approximate="tanh" (the tower's MLP) and nn.GELU() (the projector)
// y[i] = bf16(gelu(x[i])) for i < n.
#ifdef K3_HAVE_CUDA
void gelu_to_bf16(uint16_t* y, const float* x, int64_t n, Gelu form);
#else
inline void gelu_to_bf16(uint16_t*, const float*, int64_t, Gelu) {
  fail("vision::cuda::gelu_to_bf16: this build has no CUDA backend");
}
#endif

// sd2_tpool over one item: x [t, h, w, D] fp32 (its rows) to out [(h / mh) (w / mw), mh mw, D]: each mh x mw
// neighbourhood's patches side by side (row-major within it), averaged over the frames in double (the CPU's
// order), as fp32 (out_f32) and, when out_bf16 is not null, bf16.
struct MergeParams {
  float* out_f32 = nullptr;
  uint16_t* out_bf16 = nullptr;
  const float* x = nullptr;
  int64_t t = 1, h = 0, w = 0, D = 0, mh = 2, mw = 2;
};
#ifdef K3_HAVE_CUDA
std::string can_run(const MergeParams& p);
void merge_tpool(const MergeParams& p);
#else  // a build without the CUDA backend: the entry points say so
inline std::string can_run(const MergeParams&) { return "this build has no CUDA backend"; }
inline void merge_tpool(const MergeParams&) { fail("vision::cuda::merge_tpool: this build has no CUDA backend"); }
#endif

}  // namespace k3::vision::cuda
