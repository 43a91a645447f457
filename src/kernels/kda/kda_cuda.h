// Kimi Delta Attention (KDA) on the GPU (sm_90a, H100/H200): host launchers for the CUDA twins of
// kernels/kda/kda.h. Plain C++ (no CUDA headers): every pointer here is a DEVICE pointer, every kernel
// runs on the default stream, and a launcher returns as soon as its kernels are queued.
//
// Shapes and letters. B independent sequences of T tokens each (equal lengths), H heads, head dim D for
// q/k/v: the KDA kernels take Dk = Dv = D in {32, 64, 128} (K3: 128; k3-small / k3-1b: 64; k3-tiny: 32),
// each D its own instantiation; the elementwise kernels take any D.
// Activations are token-major like the CPU twin, with the batch outermost: x[b][t][h][d] at
// ((b*T + t)*H + h)*D + d. bf16 on the host side is uint16_t (core/dtype.h converts).
//
//   kernel                    CPU twin (kda.h)            dtypes
//   short_conv_silu           short_conv_silu_forward     x/out bf16 or fp32, weight and tail fp32
//   l2norm_heads              l2norm_heads                bf16 or fp32, in place, fp32 sum of squares
//   gate_forward              gate_forward                z bf16 or fp32, g fp32
//   kda_chunk_forward         kda_chunk_forward (C = 16)  q/k/v bf16 (fast path) or fp32 (parity path),
//                                                         g/beta fp32, state fp32, o bf16 or fp32
//   kda_recurrent_forward     kda_recurrent_forward       the fused token-by-token recurrence; decode is T = 1
//   gated_rmsnorm             gated_rmsnorm_forward       bf16 or fp32
//
// ---------------------------------------------------------------------------------------------------------
// THE CHUNKED FORM ON TENSOR CORES (kda_chunk_forward), and its numerics.
//
// Two kernels, as FlashKDA splits it (its deep dive measured >= 15 % over one fused kernel):
//   1. prepare (token-parallel: one CTA per sequence, 16-token chunk and head). With Gamma_i the inclusive
//      cumulative sum of g inside the chunk (per key channel) and scale folded into q:
//        Qd = scale q e^Gamma,  Kd = k e^Gamma,  Ki = k e^-Gamma,  Kr = k e^(Gamma_15 - Gamma),  gamma = e^Gamma_15
//        A  = Kd Ki^T   L = Diag(beta) StrictLower(A)      M = Lower(Qd Ki^T)    (16x16, MMA over D channels)
//        Aw = (I + L)^-1 Diag(beta)                                           (16x16 forward substitution)
//        Mw = M Aw,   Kw = Aw Kd,   Qw = Qd - Mw Kd                           (MMA)
//      and writes Qw, Kw, -Kr, -Aw, Mw, gamma to a workspace (kda_chunk_workspace_bytes).
//   2. recurrence (state-parallel: one CTA per sequence, head and slice of the value columns; a group of
//      1, 2 or 4 warps owns 16 value columns of the state for the whole sequence, S^T held in fp32
//      registers, each warp D, D/2 or D/4 of the key columns). Per chunk:
//        [O^T | Y] = S^T [Qw^T | Kw^T] + V^T [Mw^T | -Aw^T]      (Y = -U^T,  U = Aw (V - Kd S))
//        S^T      <- Diag(gamma) on the columns of S^T, then S^T += Y (-Kr)   (= S^T + U^T Kr)
//      which is the CPU twin's  O = Qd S + M U,  S' = Diag(gamma) S + Kr^T U  with the 16x16 products
//      folded in. The value columns of the state never interact, so the slices need no communication,
//      and the accumulator layout of S^T IS the A-operand layout of the next product (no shared memory
//      round trip for the state). Splitting the keys over warps (KW > 1) makes [O^T | Y] a sum of KW
//      partial products, reduced through shared memory (one barrier per chunk); each warp then updates
//      its own key columns with the full Y. The split is chosen when CTAs are few (the busiest SM would
//      hold fewer than 4 warps, e.g. B1 H16: one 16-column group per SM), so that the chunk step of a
//      group is spread over the SM's four tensor-core sub-partitions instead of issued by one warp.
//      The next chunks' tiles stream in with cp.async, 4 stages deep (2 on the fp32 path).
// Every product, the diagonal 16x16 tiles included, is an mma.sync.m16n8k16 bf16 -> fp32; there is no
// per-position path. Masks (strict lower for L, lower for M) are applied by SELECTION of the fp32
// accumulator (i > j ? x : 0), never by multiplying by a 0/1 mask: the masked entries of Kd Ki^T carry
// e^(Gamma_i - Gamma_j) with j > i, up to e^75 |k_i||k_j|, and 0 * inf would be NaN had they overflowed.
//
// Why every 16-token tile is safe (the lower bound is what makes it so). K3's gate is
// g = -5 sigmoid(...) in [-5, 0], so within a chunk 0 >= Gamma_i >= -5 * 16 = -80. Hence
//   e^Gamma in [e^-80, 1] = [1.8e-35, 1]   (normal in bf16 and fp32: min normal 1.2e-38 = e^-87.3)
//   e^-Gamma in [1, e^80] = [1, 5.5e34]    (max bf16/fp32 3.4e38 = e^88.7: 6100x to spare)
// so the split factors Kd = k e^Gamma and Ki = k e^-Gamma exist as bf16 numbers and their product, summed
// in fp32 accumulators, never overflows (|entry| <= e^80 * |q||k|, and q, k are L2-normalised). Chunk 17
// would still fit (e^85), chunk 18 would not (e^90 = 1.2e39). CONTRACT: g must lie in [-5, 0] (what
// gate_forward with lower_bound -5 produces); a gate below -5.4 can overflow e^-Gamma.
//
// Where fp32 is kept. The state S, every MMA accumulator, Gamma and the exponentials, the forward
// substitution, gamma, and the sum O + ... are fp32. The prepare kernel feeds its MMAs with split
// operands (x = hi + lo, two bf16 numbers; hi*hi + hi*lo + lo*hi, relative error ~2^-16), so A, M, Aw,
// Mw, Kw, Qw are fp32-accurate before they are rounded once to bf16 for the workspace.
// In the recurrence of the bf16 path the state S stays fp32 (it accumulates in fp32 MMA accumulators and
// is decayed in fp32), but its copy fed to the product [O^T | Y] is rounded once to bf16 per chunk, and
// so is Y in the state update S^T += Y (-Kr): 2^-9 relative each, like fla's chunk_kda (bf16 state into
// the output product, bf16 v_new into the update). Why that is enough: (a) the bf16 path already rounds
// its inputs and every workspace tile (Qw, Kw, Kr, Aw, Mw) to bf16, 2^-9 relative each, so two more
// roundings of the same size change the error's constant, not its order; (b) only the copy is rounded,
// never the state itself, so the rounding does not compound from chunk to chunk; an error put into the
// state by one chunk's Y is then multiplied by the decay (gamma <= 1) and the delta rule's projection
// (I - beta k k^T), so it fades instead of growing with T (see the accuracy below; the bar is 1e-2).
// It halves the recurrence's MMAs.
// The fp32 path (q/k/v fp32) keeps every product split: the state as S_hi + S_lo (~2^-17 relative), Y
// likewise, and the workspace tiles and v as hi/lo planes, multiplying hi*hi + hi*lo + lo*hi everywhere:
// every product is then fp32-accurate to ~2^-16 (parity with the CPU).
//
// Cost. With few CTAs (B1 H16: one CTA of 4 warps per SM, one warp per scheduler) the recurrence's time
// follows the instruction count of its 16-token chunk step, not the bytes it moves. Hence the workspace
// item is stored pre-swizzled and copied as one flat run, and shared memory is addressed with 32-bit
// offsets (kda_cuda_chunk.cu). Times against fla's chunk_kda: docs/BENCHMARKS.md; the profile, and the
// variants that did not pay (64-token steps, bulk copies): docs/CUDA.md, KDA.
// Accuracy against the CPU twin (relative L2, D = 128): bf16 path o ~2.5e-3, state ~2.2e-3 (also at T = 65536);
// fp32 path o ~7e-6, state ~6e-6.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace k3::kda::cuda {

// ---------------------------------------------------------------------------------------------------------
// Causal depthwise conv (K taps, no bias) + SiLU over B sequences of T tokens of C channels.
//   out, x: [B][T][C]    weight: [C][K] fp32    tail: [B][K-1][C] fp32 or nullptr (zeros; not updated)
// Tap j multiplies input t-(K-1)+j. tail holds each sequence's previous K-1 PRE-conv inputs (oldest
// first) and is updated in place to the last K-1 inputs (as the CPU twin, also when T < K-1). A decode
// step is T = 1. out must not alias x. K in [1, 8]. tail_slot (optional): [B] device indices, sequence b's
// tail is entry tail_slot[b] of `tail` (a pool's sequences in any order).
void short_conv_silu(float* out, const float* x, int64_t B, int64_t T, int64_t C, const float* weight, int K,
                     float* tail, const int32_t* tail_slot = nullptr);
void short_conv_silu(uint16_t* out, const uint16_t* x, int64_t B, int64_t T, int64_t C, const float* weight, int K,
                     float* tail, const int32_t* tail_slot = nullptr);

// One decode step (T = 1) of the q, k and v convs of a KDA layer in one launch, q and k then L2-normalised per
// head: the bits of short_conv_silu (with tail_slot) on each followed by l2norm_heads on q and k. out, in: [3]
// (q, k, v) of [B][H*D]; weight [3] of [H*D][K]; tail [3] of [slots][K-1][H*D], updated; tail_slot: [B] device
// indices. D a multiple of 32 up to 128.
void conv_qkv_decode(float* const (&out)[3], const float* const (&in)[3], const float* const (&weight)[3], int K,
                     float* const (&tail)[3], const int32_t* tail_slot, int64_t B, int64_t H, int64_t D, float eps);
void conv_qkv_decode(uint16_t* const (&out)[3], const uint16_t* const (&in)[3], const float* const (&weight)[3], int K,
                     float* const (&tail)[3], const int32_t* tail_slot, int64_t B, int64_t H, int64_t D, float eps);

// In place per-head L2 normalisation of `rows` rows of H*D: x <- x / sqrt(sum_d x^2 + eps) (K3: 1e-6).
void l2norm_heads(float* x, int64_t rows, int64_t H, int64_t D, float eps);
void l2norm_heads(uint16_t* x, int64_t rows, int64_t H, int64_t D, float eps);

// Lower-bounded decay gate: g[r,h,d] = lower_bound * sigmoid(exp(A_log[h]) * (z[r,h,d] + dt_bias[h*D+d])).
//   g: [rows][H][D] fp32    z: [rows][H][D]    A_log: [H]    dt_bias: [H*D]    lower_bound < 0 (K3: -5)
// beta (optional, [rows][H] fp32): the write strength's pre-activation, made sigmoid(beta) in place in the same
// launch (the bits of elementwise::cuda::sigmoid_inplace).
void gate_forward(float* g, const float* z, const float* A_log, const float* dt_bias, float lower_bound, int64_t rows,
                  int64_t H, int64_t D, float* beta = nullptr);
void gate_forward(float* g, const uint16_t* z, const float* A_log, const float* dt_bias, float lower_bound,
                  int64_t rows, int64_t H, int64_t D, float* beta = nullptr);

// Gated output norm: y = o / sqrt(mean(o^2) + eps) * weight * sigmoid(gate), per head row of Dv.
//   y, o, gate: [rows][H][Dv]    weight: [Dv] fp32    y may alias o.
void gated_rmsnorm(float* y, const float* o, const float* gate, const float* weight, float eps, int64_t rows, int64_t H,
                   int64_t Dv);
void gated_rmsnorm(uint16_t* y, const uint16_t* o, const uint16_t* gate, const float* weight, float eps, int64_t rows,
                   int64_t H, int64_t Dv);

// ---------------------------------------------------------------------------------------------------------
// KDA core. Dk = Dv = D in {32, 64, 128} (KdaParams::D).
constexpr int kHeadDim = 128;  // K3's head dim, the default of KdaParams::D
constexpr int kChunk = 16;

struct KdaParams {
  int64_t B = 0, T = 0, H = 0;
  float scale = 0.0f;               // K3: D^-0.5
  DType in_dtype = DType::BF16;     // q, k, v: BF16 (fast path) or F32 (parity path)
  DType out_dtype = DType::BF16;    // o: BF16 or F32
  const void* q = nullptr;          // [B][T][H][D], L2-normalised per head
  const void* k = nullptr;          // [B][T][H][D], L2-normalised per head
  const void* v = nullptr;          // [B][T][H][D]
  const float* g = nullptr;         // [B][T][H][D], log-decay in [-5, 0]
  const float* beta = nullptr;      // [B][T][H]
  const float* state_in = nullptr;  // [B][H][D key][D value] fp32, key-major like the CPU twin; nullptr = zeros
  float* state_out = nullptr;       // same layout; nullptr = not written; may equal state_in
  // kda_recurrent_forward only: [B] device indices; sequence b's state is entry state_slot[b] of state_in and
  // state_out (a pool's sequences in any order). nullptr: entry b.
  const int32_t* state_slot = nullptr;
  void* o = nullptr;                // [B][T][H][D]
  void* workspace = nullptr;        // kda_chunk_forward only: kda_chunk_workspace_bytes(B, T, H, in_dtype, D) bytes
  size_t workspace_bytes = 0;
  // kda_chunk_forward only, for benchmarks: run both kernels (the default), only the prepare kernel, or
  // only the recurrence kernel (which then reads the workspace a previous call with the same inputs left).
  enum class Stage : uint8_t { kAll, kPrepareOnly, kRecurrenceOnly } stage = Stage::kAll;
  // kda_chunk_forward only: the prepare kernel's register cap, as resident CTAs per SM asked of the
  // compiler (__launch_bounds__). kAuto is the shipped choice: 8 CTAs (64 registers) at D = 128, no cap
  // at D = 32 and 64. k7Ctas (72 registers; at D = 128 only, elsewhere as kAuto) and kUncapped are the
  // forms it was measured against, kept for bench_cuda_kda: the prepare kernel took 0.594 / 0.619 /
  // 0.749 ms at B1 T8192 H64 D128 on the H200 (docs/CUDA.md). The same code under another register
  // budget: all three give the same bits (tested).
  enum class PrepareCap : uint8_t { kAuto, k7Ctas, kUncapped } prepare_cap = PrepareCap::kAuto;
  // Head dim, Dk = Dv = D: 32, 64 or 128. Last and an int, after the two one-byte enums: together they
  // fill the tail padding, so the struct (a kernel parameter of kda_recurrent_forward) keeps its size
  // and layout.
  int D = kHeadDim;
};

// Workspace of kda_chunk_forward: one item per (sequence b, 16-token chunk n, head h), item (b*NC + n)*H + h.
// bf16 inputs, 100 D + 1024 bytes per item (D = 128: 13,824; 64: 7,424; 32: 4,224; the test reads it back):
//   bf16 Qw[16][D] @0   Kw[16][D] @32D   -Kr[16][D] @64D   -Aw[16][16] @96D   Mw[16][16] @96D+512
//   fp32 gamma[D] @96D+1024
// fp32 inputs, 260 D + 2048 bytes (D = 128: 35,328; 64: 18,688; 32: 10,368): each bf16 tile as a hi and a
// lo plane back to back (Qw hi, Qw lo, Kw hi, ...), gamma, then v's hi and lo planes [16][D].
// B1 T8192 H64 D128 bf16: 453 MB. Throws k3::Error for a D other than 32, 64, 128.
// Each bf16 tile (and plane) is stored SWIZZLED, in the exact byte order the recurrence kernel wants in
// shared memory, so that a whole item moves there as one flat run of 16-byte copies: element (row, col)
// of a 16-row tile of `width` columns is at kda_ws_tile_index(row, col, width), which permutes the
// 16-byte pieces of a row.
size_t kda_chunk_workspace_bytes(int64_t B, int64_t T, int64_t H, DType in_dtype, int64_t D = kHeadDim);

// The swizzle of the workspace tiles (width 16 for Aw/Mw, D for the others). Without padding, the rows
// of a tile are 2*width bytes apart, and the 8 rows one ldmatrix reads at the same column would fall in
// the same shared-memory bank group (width >= 64) or in two to four (width 16, 32): piece p of row r is
// therefore stored at piece p XOR x(r), x(r) = r mod 8 (width >= 64), (r / 2) mod 4 (32), (r / 4) mod 2
// (16), which puts those 8 pieces in 8 distinct 16-byte bank groups. Pieces stay whole, so the pairs of
// elements the kernels write together stay together.
constexpr int kda_ws_tile_index(int row, int col, int width) {
  const int x = width >= 64 ? (row & 7) : width == 32 ? ((row >> 1) & 3) : ((row >> 2) & 1);
  return row * width + ((((col >> 3) ^ x)) << 3) + (col & 7);
}

// Empty when kda_chunk_forward can take p, else the reason (shape, head dim, dtype, workspace, or no GPU).
std::string kda_chunk_can_run(const KdaParams& p);
// The chunked forward (16-token chunks, tensor cores). T = 0 is a no-op. Throws k3::Error with the
// reason of kda_chunk_can_run when it cannot take p.
void kda_chunk_forward(const KdaParams& p);

// Empty when kda_recurrent_forward can take p (D in {32, 64, 128}; state_in and state_out both required,
// they may alias; o has the dtype of q/k/v).
std::string kda_recurrent_can_run(const KdaParams& p);
// The fused recurrence, token by token with the state in fp32 registers: one CTA (4 D threads) per
// (sequence, head). Decode is T = 1; it also serves as the GPU reference for the chunked form.
void kda_recurrent_forward(const KdaParams& p);

// The recurrence with the ops around it in a decode step fused in: the gate from z (gate_forward's arithmetic; p.g
// is not read), beta's sigmoid (p.beta holds the pre-activation; elementwise::cuda::sigmoid_inplace's
// arithmetic), and o stored after the gated RMSNorm (gated_rmsnorm's arithmetic, y = o): the bits of
// gate_forward, sigmoid, kda_recurrent_forward and gated_rmsnorm in turn, in one launch.
struct KdaGateNorm {
  const float* z = nullptr;        // [B][T][H][D] fp32, the gate's pre-activation
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H*D]
  float lower_bound = -5.0f;
  const void* out_gate = nullptr;  // [B][T][H][D] of out_dtype: the output gate's pre-activation
  const float* o_norm = nullptr;   // [D]
  float o_eps = 1e-5f;
};
void kda_recurrent_forward(const KdaParams& p, const KdaGateNorm& f);

// For the benchmark: the number of value-column slices (CTAs per head) the recurrence kernel of
// kda_chunk_forward uses at this shape (1 .. D/16; each slice is a CTA of 16-column warp groups), chosen so that
// the busiest SM holds the fewest warps.
int kda_chunk_value_slices(int64_t B, int64_t H, DType in_dtype, int64_t D = kHeadDim);
// Likewise the key split: warps per 16 value columns (1, 2 or 4, at most D/16; 1 on the fp32 path), each
// holding D / key_warps key columns of the state, chosen to fill the busiest SM up to 4 warps (one per
// tensor-core sub-partition).
int kda_chunk_key_warps(int64_t B, int64_t H, DType in_dtype, int64_t D = kHeadDim);

}  // namespace k3::kda::cuda
