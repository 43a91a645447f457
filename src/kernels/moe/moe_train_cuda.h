// Training on the GPU: the pieces of Stable LatentMoE's forward and backward (K3-ARCHITECTURE.md §5.5)
// that are not dense GEMMs or norms, in fp32, each the twin of a float64 step of moe_ffn_forward /
// moe_ffn_backward (model/training/ffn_block.cpp):
//   router_forward_train     the sigmoid router with the scores and Σ selected scores (kernels/moe/router.h)
//   TrainDispatch            tokens grouped by expert, in ascending token order within an expert
//   gather_sorted_rows       z rows to the expert-sorted rows (and scatter_sorted_rows, its backward)
//   experts_linear_*         each expert's Linear on its sorted rows, on cuBLAS (gemm/linear_cuda.h)
//   combine_forward_train    u = Σ_k w_k y_{e_k} (and combine_backward_train: dy_e and dw)
//   router_backward_train    dlogits through the renormalisation and the sigmoid
// The activation between the expert GEMMs is ffn::cuda::glu_forward / glu_backward_train
// (ffn/glu_cuda.h, ffn/glu_train_cuda.h); the dense linears and the latent RMSNorm are elsewhere.
//
// One layer, with S = N·K sorted rows (L latent width, I expert intermediate):
//   router_forward_train(idx, w, s, ssum, logits, bias, N, rp)   logits [N, E] = x Wrᵀ
//   d.build(idx, N)                                             one host sync (per-expert row counts)
//   gather_sorted_rows(zs, z, d, L)                             zs [S, L]
//   experts_linear_forward(g, zs, W1), (u, zs, W3)              g, u [S, I]
//   glu_forward(h, g, u)                                        h [S, I]
//   experts_linear_forward(ye, h, W2)                           ye [S, L]
//   combine_forward_train(agg, ye, w, d, N, L)                  agg [N, L]
// and backward: combine_backward_train -> dye, dw; experts_linear_backward_weight/_data through W2,
// glu_backward_train, W1 and W3; scatter_sorted_rows -> dz [N, L]; router_backward_train(dw) -> dlogits.
//
// Conventions: every pointer is a DEVICE pointer (TrainDispatch::offsets() is the one host array);
// everything runs on the default stream, asynchronously, except TrainDispatch::build (one sync).
// Parameter gradients (dW) are ACCUMULATED; activation gradients are OVERWRITTEN unless said.
// Deterministic: every result is bitwise the same run to run, and a token's results do not depend on
// the other tokens of the batch except through the per-expert GEMMs' row counts (cuBLAS may pick
// another kernel for another M). No floating-point atomics: sums run in a fixed order.
// Numerics: fp32 storage and math; the dot products of combine_backward_train and the router
// backward's per-token arithmetic in fp64 (cheap, per row).
#pragma once
#include <cstdint>
#include <vector>

#include "core/cuda.h"
#include "core/dtype.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/moe/router.h"

namespace k3::moe::cuda {

// ---- router ---------------------------------------------------------------------------------------
// The twin of the float64 router_forward (router.h) in fp32, on moe_cuda.h's router kernel (same
// selection: biased top-k, group limit, ties to the lower expert; NaN selects last):
//   idx [N, K]     selected experts in selection order
//   weight [N, K]  s_j / (Σ_sel s + 1e-20) if p.renormalize, else s_j; times p.scaling
//   scores [N, E]  unbiased sigmoid scores s (Quantile Balancing reads them); may be null
//   sel_sum [N]    Σ_sel s (the renormalisation's denominator without 1e-20; summed in fp64); may be null
// logits [N, E]; bias [E] (selection only) or null. Throws k3::Error with router_can_run's reason.
void router_forward_train(int32_t* idx, float* weight, float* scores, float* sel_sum, const float* logits,
                          const float* bias, int64_t N, const RouterParams& p);
// Router replay (the float64 router_forward's `forced`): after router_forward_train, rows use the experts
// forced [N, K] (device, each in [0, E): the caller checks) instead of their own selection. idx, weight and sel_sum
// are OVERWRITTEN from `scores` by router_forward_train's arithmetic (fp64 sum in k order, rounded once), so
// forcing a row's own selection gives the same bits.
void router_force_train(int32_t* idx, float* weight, float* sel_sum, const float* scores, const int32_t* forced,
                        int64_t N, const RouterParams& p);

// dlogits [N, E] OVERWRITTEN from dweight [N, K] (the gradient of the mixture weights), as the loop at
// the end of moe_ffn_backward: with c = p.scaling, S = sel_sum + 1e-20, for a selected j
//   ds_j = c (dw_j / S − Σ_k dw_k s_k / S²)   (renormalised)   or   c dw_j   (not)
//   dlogit_j = ds_j s_j (1 − s_j);   unselected experts get 0.
// scores [N, E], idx [N, K], sel_sum [N] from router_forward_train (sel_sum may be null when
// !p.renormalize). Per-token arithmetic in fp64, rounded once; s (1 − s) is formed from the fp32 score,
// so near s = 1 its relative error grows like 2^-24 / (1 − s), on entries that are small there.
void router_backward_train(float* dlogits, const float* dweight, const float* scores, const int32_t* idx,
                           const float* sel_sum, int64_t N, const RouterParams& p);

// ---- dispatch -------------------------------------------------------------------------------------
// The routed slots (n, k) sorted by expert, tokens in ascending order within an expert (a stable
// counting sort: no value depends on thread timing). Owns its device buffers for up to max_tokens
// tokens; E <= 8192.
class TrainDispatch {
 public:
  TrainDispatch(int64_t max_tokens, int64_t E, int64_t K);
  // From idx [N, K] on the device (entries in [0, E); a token's K experts distinct, as the router's):
  //   pos [N, K]       the sorted row of slot (n, k)
  //   token [N·K]      the token of each sorted row
  //   offsets [E+1]    expert e owns sorted rows [offsets[e], offsets[e+1]); on the device and copied
  //                    to the host (one synchronisation: the per-expert GEMMs need the counts).
  // Throws k3::Error naming the count of entries outside [0, E) (after the sync).
  void build(const int32_t* idx, int64_t N);

  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return K_; }
  int64_t tokens() const { return N_; }     // N of the last build()
  int64_t rows() const { return N_ * K_; }  // S, the sorted rows
  const int32_t* pos() const { return pos_.data(); }
  const int32_t* token() const { return token_.data(); }
  const int32_t* offsets_device() const { return offsets_.data(); }
  const std::vector<int64_t>& offsets() const { return offsets_host_; }  // host copy, [E+1]

 private:
  int64_t E_, K_, max_tokens_, N_ = 0;
  // offsets_ holds E+2 ints: the offsets, then the count of bad indices (read back with them).
  // chunk_ [max_chunks, E]: per chunk of slots, its per-expert counts, then their exclusive scan.
  k3::cuda::DeviceBuffer<int32_t> pos_, token_, offsets_, chunk_;
  std::vector<int64_t> offsets_host_;
};

// xs[r] = x[token[r]] (rows of width L) for the S sorted rows. xs [S, L], x [N, L] fp32.
void gather_sorted_rows(float* xs, const float* x, const TrainDispatch& d, int64_t L);
// dx[n] = Σ_k dxs[pos[n, k]] in k order (OVERWRITTEN): the backward of gather_sorted_rows. dx [N, L].
void scatter_sorted_rows(float* dx, const float* dxs, const TrainDispatch& d, int64_t N, int64_t L);

// agg[n] = Σ_k weight[n, k] · y[pos[n, k]] in k order (fp32 fma from 0; the CPU sums in expert order).
// agg [N, L] OVERWRITTEN, y [S, L], weight [N, K].
void combine_forward_train(float* agg, const float* y, const float* weight, const TrainDispatch& d, int64_t N,
                           int64_t L);
// dy[pos[n, k]] = weight[n, k] · dagg[n]  and  dweight[n, k] = <dagg[n], y[pos[n, k]]> (fp64 sum in a
// fixed order, rounded once); both OVERWRITTEN. dy [S, L], dweight [N, K], dagg [N, L], y [S, L].
void combine_backward_train(float* dy, float* dweight, const float* dagg, const float* y, const float* weight,
                            const TrainDispatch& d, int64_t N, int64_t L);

// ---- expert linears over the sorted rows ----------------------------------------------------------
// Expert e's Linear y = x W_eᵀ on its sorted rows [offsets[e], offsets[e+1]), one cuBLAS call per
// expert that has rows (linear_forward / linear_weight_grad of gemm/linear_cuda.h; experts with no
// rows are skipped). W is stacked [E, out, in] row-major: one pointer, expert e at W + e·out·in elements.
// in_type: F32 (pedantic fp32, TF32 off: the f32 training mode) or BF16 (tensor cores, fp32
// accumulation: the caller passes bf16 copies of the operands named void*). Outputs fp32.
//   forward          y [S, out] = x [S, in] · W_eᵀ per expert (OVERWRITTEN)
//   backward_data    dx [S, in] = dy [S, out] · W_e (OVERWRITTEN, or added when accumulate)
//   backward_weight  dW_e [out, in] += dy_eᵀ · x_e (ACCUMULATED; experts with no rows untouched)
void experts_linear_forward(gemm::cuda::GemmContext& ctx, float* y, const void* x, const void* W, DType in_type,
                            const TrainDispatch& d, int64_t out, int64_t in);
void experts_linear_backward_data(gemm::cuda::GemmContext& ctx, float* dx, const void* dy, const void* W, DType in_type,
                                  const TrainDispatch& d, int64_t out, int64_t in, bool accumulate = false);
void experts_linear_backward_weight(gemm::cuda::GemmContext& ctx, float* dW, const void* dy, const void* x,
                                    DType in_type, const TrainDispatch& d, int64_t out, int64_t in);

}  // namespace k3::moe::cuda
