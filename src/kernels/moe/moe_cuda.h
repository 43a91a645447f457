// LatentMoE routed experts on the GPU (H100/H200, sm_90a): router, dispatch, grouped expert GEMMs
// with SiTU-GLU fused into the gate/up GEMM, and the weighted combine. CPU twins: kernels/moe/router.h
// (router), kernels/ffn/glu.h (SiTU-GLU), kernels/gemm/linear.h + gemm/mxfp4.h (expert Linears).
//
// Plain C++ header: every pointer is a DEVICE pointer, every call runs on the default stream and is
// asynchronous (synchronise before reading results on the host). bf16 is uint16_t (core/dtype.h).
//
// Dimension letters: T tokens, E experts, K top-k, S = T*K routed slots, L latent width
// (routed_expert_hidden_size), I expert intermediate (moe_intermediate_size).
//
// One MoE layer's routed path (K3-ARCHITECTURE.md §5.5, steps 1, 3, 4 before the latent RMSNorm):
//   router_forward(idx, w, logits, bias, T, rp)        logits [T,E] fp32 -> idx [T,K], w [T,K]
//   Dispatch d(T_max, E, K);  d.build(idx, T)           counts, offsets, sorted slots, tile list
//   expert_gate_up(h, z, d, w1, w3, glu)                h [S,I] = SiTU-GLU(z W1ᵀ, z W3ᵀ), rows sorted by expert
//   expert_down(y, h, d, w2)                            y [S,L] = h W2ᵀ (per expert)
//   combine(u, y, w, d)                                 u [T,L] fp32 = Σ_k w[t,k] y[slot(t,k)]
// `experts_forward` runs the last four in order.
//
// Numerics: bf16 operands on tensor cores, fp32 accumulation (bf16 weights on 128-row tiles: Hopper
// wgmma, moe_gemm_sm90.cu; MXFP4 weights and 64-row tiles: mma.sync m16n8k16); SiTU in fp32 on the
// fp32 accumulators, rounded once to bf16 for h; expert outputs y rounded to bf16 (as HF's experts
// return the activation dtype), the weighted sum in fp32 in a fixed k order (deterministic: slots
// are placed by atomics, but no value depends on where a row lands). MXFP4 weights are decoded
// exactly (e2m1 × 2^(s−127) in fp32, then to bf16, exact for scales 2..252) in shared memory inside
// the GEMM, so an MXFP4 expert gives bit-for-bit the result of its bf16 dequantisation on the same
// (mma.sync) kernel (both kernels run the same k16 steps in the same order, but nothing promises that
// wgmma and mma.sync round alike).
// The router is fp32 with the CPU twin's stable sigmoid, its tie rule (lower expert index wins) and
// its fp64 renormalisation sum.
#pragma once
#include <cstdint>
#include <string>

#include "core/cuda.h"
#include "kernels/ffn/glu.h"
#include "kernels/moe/router.h"

namespace k3::moe::cuda {

using bf16 = uint16_t;

// The tile of the grouped GEMMs: TM rows of one expert × 256 weight rows (gate/up: 128 columns of h
// from 128 gate + 128 up weight rows) at TM = 128, × 128 weight rows at TM = 64; BK = 64 per pipeline
// stage. TM is 128 or 64, chosen per build() from the average rows per expert (rows of a tile past the
// expert's count are zero-filled and not stored; their MMAs are skipped per 16-row block on the
// mma.sync kernel, per 64-row half on the wgmma kernel).
inline constexpr int kTileM = 128;

// ---- router -------------------------------------------------------------------------------------
// Reason the router cannot take these parameters, or "" (E up to 8192, K <= E, groups dividing E).
std::string router_can_run(const RouterParams& p);
// idx [T,K] int32 (selection order: biased score descending, ties to the lower expert), weight [T,K]
// fp32 (unbiased sigmoid scores of the selected, renormalised if p.renormalize, × p.scaling).
// logits [T,E] fp32; bias [E] fp32 or nullptr.
void router_forward(int32_t* idx, float* weight, const float* logits, const float* bias, int64_t T,
                    const RouterParams& p);

// ---- dispatch (tokens sorted by expert) ---------------------------------------------------------
// Owns the device index buffers for up to max_tokens tokens. build() reads idx [T,K] (every entry in
// [0,E)) and fills, all on the device:
//   counts [E]        rows routed to each expert
//   offsets [E+1]     exclusive prefix sum of counts: expert e owns sorted rows [offsets[e], offsets[e+1])
//   slot_token [S]    token of each sorted row
//   slot_of [T*K]     sorted row of (t, k)
//   tiles [2*max_tiles], num_tiles [1]: (expert, first row within the expert) of each TM-row tile
// tile_m: 64 or 128 to force the GEMMs' tile rows, 0 to choose from S/E.
// Up to kPlanSmallSlots slots (decode steps; with E <= kPlanSmallExperts) the plan is one single-CTA launch with
// shared-memory counters; larger builds take a memset, a counting kernel, the scan and a scatter kernel.
class Dispatch {
 public:
  static constexpr int64_t kPlanSmallSlots = 16384, kPlanSmallExperts = 4096;
  Dispatch(int64_t max_tokens, int64_t num_experts, int64_t top_k);
  void build(const int32_t* idx, int64_t T, int tile_m = 0);

  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return K_; }
  int64_t tokens() const { return T_; }             // T of the last build()
  int64_t slots() const { return T_ * K_; }         // S
  int64_t max_tiles() const { return max_tiles_; }  // grid bound for the last build()
  int tile_m() const { return tile_m_; }            // TM of the last build()
  const int32_t* counts() const { return counts_.data(); }
  const int32_t* offsets() const { return offsets_.data(); }
  const int32_t* slot_token() const { return slot_token_.data(); }
  const int32_t* slot_of() const { return slot_of_.data(); }
  const int32_t* tiles() const { return tiles_.data(); }
  const int32_t* num_tiles() const { return num_tiles_.data(); }

 private:
  int64_t E_, K_, max_tokens_, T_ = 0, max_tiles_ = 0;
  int tile_m_ = kTileM;
  k3::cuda::DeviceBuffer<int32_t> counts_, offsets_, cursor_, slot_token_, slot_of_, tiles_, num_tiles_;
};

// ---- expert weights -----------------------------------------------------------------------------
// One Linear per expert, all experts stacked: expert e's weight is [rows, cols] (PyTorch [Out, In])
// at data + e*expert_stride bytes. BF16: row-major bf16. MXFP4 (gemm/mxfp4.h): data is packed
// [rows, cols/2] bytes (low nibble = even element), scales [rows, cols/32] E8M0 bytes at
// scales + e*scale_stride.
struct ExpertLinear {
  enum class Format { BF16, MXFP4 };
  Format format = Format::BF16;
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;
  int64_t expert_stride = 0;  // bytes between experts in data
  const uint8_t* scales = nullptr;
  int64_t scale_stride = 0;  // bytes between experts in scales

  // Stacked, densely packed experts (stride = one expert's bytes).
  static ExpertLinear bf16_stacked(const bf16* w, int64_t rows, int64_t cols);
  static ExpertLinear mxfp4_stacked(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols);
};

// Reason a grouped GEMM cannot take these weights, or "": cols % 8 (BF16) or % 32 (MXFP4), rows % 8,
// cols <= 16384 (MXFP4 keeps a tile's scales in shared memory), 16-byte aligned rows.
std::string gemm_can_run(const ExpertLinear& w);

// ---- how the grouped GEMMs run ---------------------------------------------------------------------
// Two kernels share the tile list and the epilogue: the Hopper wgmma kernel (moe_gemm_sm90.cu) and the
// mma.sync kernel (moe_cuda.cu). The defaults are the shipped choice, the heuristic: wgmma for bf16
// weights on a 128-row tile list, mma.sync for MXFP4 weights and 64-row lists, each in its fastest
// measured form (docs/CUDA.md, "LatentMoE"); Dispatch::build picks the tile rows. The other values are
// for benchmarks and tests. Each runs the same k16 steps per output element in the same order, so it
// gives its kernel's bits (test KernelVariantsAreBitwiseEqual); the tests use them to reach paths the
// shipped sizes rarely take (many work items per CTA, 128-row weight tiles), bench_cuda_moe times them
// by name (gemm_config_name).
struct GemmConfig {
  // kAuto: the heuristic above. kMmaSync: bf16 weights on 128-row lists run on the mma.sync kernel too
  // (the kernel before wgmma; one H200 run at K3's sizes, 16,384 tokens: 39.8% of cuBLAS, wgmma 51.9%).
  enum class Kernel : uint8_t { kAuto, kMmaSync };
  Kernel kernel = Kernel::kAuto;
  // Both kernels: work in expert-major order (an expert's column tiles in turn, its row tiles
  // innermost), so the CTAs reading one weight tile run side by side and share one DRAM read. false:
  // row tile by row tile, each sweeping all column tiles (a weight tile returns only after a whole
  // expert's weights have passed through L2).
  bool expert_raster = true;
  // Both kernels: skip the MMAs of rows past the expert's count (per 16-row block on mma.sync, per
  // consumer warpgroup's 64 rows on wgmma). false: multiply the zero-filled rows too.
  bool skip_empty_rows = true;
  // mma.sync kernel at 128 tile rows: 128 weight rows per tile instead of 256. MXFP4 weights take 128
  // anyway where the K/32 scale bytes of 256 rows would not fit shared memory (K > 12,672).
  bool narrow_weight_tiles = false;
  // wgmma kernel: at most this many persistent CTAs; 0 = one per SM. 3 makes each CTA take many work
  // items, so its ring of item slots wraps (tests).
  int max_ctas = 0;
  // wgmma kernel: CTAs take work items from an atomic counter in raster order. false: the static
  // schedule, CTA c takes items c, c + grid, ... (down GEMM 17.3 against 11.9 ms, docs/CUDA.md).
  bool dynamic_schedule = true;
};

// The name bench_cuda_moe and the tests print: "default", or the changed fields joined by '+' in this
// order: "mma.sync", "row-major", "no-skip", "narrow", "ctas=N", "static" (e.g. "mma.sync+narrow").
std::string gemm_config_name(const GemmConfig& c);
// The inverse of gemm_config_name (the parts in any order, none twice). Throws k3::Error naming the text
// and the part it does not know.
GemmConfig parse_gemm_config(const std::string& name);

// ---- grouped GEMMs (one launch for all experts) ---------------------------------------------------
// y [S, w.rows] bf16 (sorted rows) = X_e W_eᵀ for every expert e, where row r of the sorted order reads
// x[(x_rows ? x_rows[r] : r) * w.cols ...] (x_rows = d.slot_token() gathers token rows directly).
void grouped_gemm(bf16* y, const bf16* x, const int32_t* x_rows, const Dispatch& d, const ExpertLinear& w,
                  const GemmConfig& cfg = {});

// h [S, I] bf16 = SiTU-GLU(z W1ᵀ, z W3ᵀ) per expert; z [T, L] bf16 in token order (gathered in the
// GEMM's loader); w1 (gate) and w3 (up) are [I, L] in the same format.
void expert_gate_up(bf16* h, const bf16* z, const Dispatch& d, const ExpertLinear& w1, const ExpertLinear& w3,
                    const GluParams& glu, const GemmConfig& cfg = {});
// y [S, L] bf16 = h W2ᵀ per expert; w2 [L, I].
void expert_down(bf16* y, const bf16* h, const Dispatch& d, const ExpertLinear& w2, const GemmConfig& cfg = {});
// u [T, L] fp32 = Σ_k weight[t,k] · y[slot_of(t,k)], k ascending. L % 8 == 0.
void combine(float* u, const bf16* y, const float* weight, const Dispatch& d, int64_t L);
// The same over T tokens' K outputs each, y's rows named by slot_of [T, K], or in slot order (t K + k) when it is
// null (expert_rows_cuda.h writes them so).
void combine(float* u, const bf16* y, const float* weight, int64_t T, int64_t K, int64_t L, const int32_t* slot_of);
// normed [T, L] bf16 = RMSNorm(u) (weight norm_weight [L] or none, eps) of combine's u, in one launch: the same sums,
// then norm_cuda's formula in fp32. L % 8 == 0, L <= 8192.
void combine_rmsnorm(bf16* normed, const bf16* y, const float* weight, const Dispatch& d, int64_t L,
                     const float* norm_weight, float eps);
// The same over T tokens' K outputs each, y's rows named by slot_of [T, K], or in slot order (t K + k) when it
// is null (expert_rows_cuda.h writes them so).
void combine_rmsnorm(bf16* normed, const bf16* y, const float* weight, int64_t T, int64_t K, int64_t L,
                     const int32_t* slot_of, const float* norm_weight, float eps);

// The routed experts after routing: gate/up + SiTU, down, combine. h [S, I] and y [S, L] are caller
// workspace (bf16). Returns u [T, L] fp32 (before the latent RMSNorm).
void experts_forward(float* u, bf16* h, bf16* y, const bf16* z, const float* weight, const Dispatch& d,
                     const ExpertLinear& w1, const ExpertLinear& w3, const ExpertLinear& w2, const GluParams& glu,
                     const GemmConfig& cfg = {});

// y[i] = the grouped GEMMs' gate/up epilogue (moe_glu: SiTU-GLU or SwiGLU in fp32 with the hardware's
// tanh, exp and reciprocal) of g[i], u[i]; device pointers (tests: its error against exact arithmetic).
void glu_eval(float* y, const float* g, const float* u, int64_t n, const GluParams& glu);

// Benchmark/test data made on the device (a counter hash, reproducible from seed): bf16 uniform in
// [-scale, scale]; bytes uniform in [lo, hi] (MXFP4 packed nibbles with lo = 0, hi = 255; E8M0 scales).
void fill_random_bf16(bf16* dst, int64_t n, float scale, uint64_t seed);
void fill_random_u8(uint8_t* dst, int64_t n, int lo, int hi, uint64_t seed);

}  // namespace k3::moe::cuda

#ifndef K3_HAVE_CUDA
#include "core/error.h"
namespace k3::moe::cuda {
inline std::string router_can_run(const RouterParams&) { return "this build has no CUDA backend"; }
inline void router_forward(int32_t*, float*, const float*, const float*, int64_t, const RouterParams&) {
  fail("moe::cuda::router_forward: this build has no CUDA backend");
}
inline Dispatch::Dispatch(int64_t, int64_t, int64_t) : E_(0), K_(0), max_tokens_(0) {
  fail("moe::cuda::Dispatch: this build has no CUDA backend");
}
inline void Dispatch::build(const int32_t*, int64_t, int) {
  fail("moe::cuda::Dispatch::build: this build has no CUDA backend");
}
inline ExpertLinear ExpertLinear::bf16_stacked(const bf16* w, int64_t rows, int64_t cols) {
  return ExpertLinear{Format::BF16, rows, cols, w, rows * cols * 2, nullptr, 0};
}
inline ExpertLinear ExpertLinear::mxfp4_stacked(const uint8_t* p, const uint8_t* s, int64_t rows, int64_t cols) {
  return ExpertLinear{Format::MXFP4, rows, cols, p, rows * cols / 2, s, rows * cols / 32};
}
inline std::string gemm_can_run(const ExpertLinear&) { return "this build has no CUDA backend"; }
inline void grouped_gemm(bf16*, const bf16*, const int32_t*, const Dispatch&, const ExpertLinear&, const GemmConfig&) {
  fail("moe::cuda::grouped_gemm: this build has no CUDA backend");
}
inline void expert_gate_up(bf16*, const bf16*, const Dispatch&, const ExpertLinear&, const ExpertLinear&,
                           const GluParams&, const GemmConfig&) {
  fail("moe::cuda::expert_gate_up: this build has no CUDA backend");
}
inline void expert_down(bf16*, const bf16*, const Dispatch&, const ExpertLinear&, const GemmConfig&) {
  fail("moe::cuda::expert_down: this build has no CUDA backend");
}
inline void combine(float*, const bf16*, const float*, const Dispatch&, int64_t) {
  fail("moe::cuda::combine: this build has no CUDA backend");
}
inline void combine(float*, const bf16*, const float*, int64_t, int64_t, int64_t, const int32_t*) {
  fail("moe::cuda::combine: this build has no CUDA backend");
}
inline void combine_rmsnorm(bf16*, const bf16*, const float*, const Dispatch&, int64_t, const float*, float) {
  fail("moe::cuda::combine_rmsnorm: this build has no CUDA backend");
}
inline void combine_rmsnorm(bf16*, const bf16*, const float*, int64_t, int64_t, int64_t, const int32_t*, const float*,
                            float) {
  fail("moe::cuda::combine_rmsnorm: this build has no CUDA backend");
}
inline void experts_forward(float*, bf16*, bf16*, const bf16*, const float*, const Dispatch&, const ExpertLinear&,
                            const ExpertLinear&, const ExpertLinear&, const GluParams&, const GemmConfig&) {
  fail("moe::cuda::experts_forward: this build has no CUDA backend");
}
inline void glu_eval(float*, const float*, const float*, int64_t, const GluParams&) {
  fail("moe::cuda::glu_eval: this build has no CUDA backend");
}
inline void fill_random_bf16(bf16*, int64_t, float, uint64_t) { fail("moe::cuda::fill_random_bf16: no CUDA backend"); }
inline void fill_random_u8(uint8_t*, int64_t, int, int, uint64_t) {
  fail("moe::cuda::fill_random_u8: no CUDA backend");
}
}  // namespace k3::moe::cuda
#endif
