// Training on the GPU: the routed experts' three GEMM kinds over the expert-sorted rows, each ONE
// launch over all experts on Hopper's warpgroup MMA (wgmma, bf16 operands, fp32 accumulation, fp32
// outputs; expert_gemm_train_cuda.cu has the design).
// The one-launch twins of experts_linear_forward / _backward_data / _backward_weight (moe_train_cuda.h)
// with in_type = BF16, which run one cuBLAS call per expert.
//
// Layout (TrainDispatch, moe_train_cuda.h): S sorted rows; expert e owns rows [off[e], off[e+1]) with
// off = offsets [E+1] int32 ON THE DEVICE (TrainDispatch::offsets_device()), ascending, off[0] = 0,
// off[E] = S. W is stacked [E, out, in] row-major bf16: expert e at W + e·out·in elements. No host
// synchronisation: the row counts are read on the device.
//   forward          y [S, out] (=|+=) x [S, in] · W_eᵀ          per row r of expert e
//   backward_data    dx [S, in] (=|+=) dy [S, out] · W_e         (OVERWRITTEN, or added when accumulate)
//   backward_weight  dW_e [out, in] += dy_eᵀ · x_e               summed over the expert's rows
//                    (ACCUMULATED into fp32 dW [E, out, in]; experts with no rows are untouched)
// bf16 operands are uint16_t bit patterns (moe_cuda.h's bf16), passed as void* like experts_linear_*.
//
// Requirements (k3::Error naming the function and the argument otherwise): out and in positive
// multiples of 8; bf16 pointers 16-byte aligned, fp32 pointers 8-byte aligned; S, E within int32.
// `workspace` (forward and backward_data) is device scratch of grouped_linear_workspace_bytes(E) bytes:
// the per-expert prefix of 128-row tiles, rebuilt by every call (so callers may share one buffer).
// The launches share one device-wide schedule counter with the inference grouped GEMM: issue them on
// the default stream from one host thread (as the CUDA backend does).
//
// Numerics and determinism: every output element is one fp32 accumulator chain over k in ascending
// blocks of 16 (the tensor core's own order inside a block), owned by one CTA; no atomics, no split-k.
// So results are bitwise the same run to run, and a row's forward / backward-data result does not
// depend on the other rows of the batch (unlike a per-expert cuBLAS call, whose kernel depends on M).
// Against the float64 product of the same bf16 values (bf16 products are exact in fp32): if the tensor
// cores' adds round toward zero, as published models of them say, the error grows like (k/16)·2^-24
// rather than sqrt(k)·2^-24: a simulation of that model gives relative L2 ~4.5e-6 at k = 3584 and
// ~1e-5 at k = 7168 (round-to-nearest fp32 FMAs: 6e-7 and 9e-7). cuBLAS's bf16 GEMM runs on the same adders.
// Everything runs on the default stream, asynchronously; device pointers only.
#pragma once
#include <cstddef>
#include <cstdint>

namespace k3::moe::cuda {

// Bytes of workspace grouped_linear_forward_bf16 / grouped_linear_backward_data_bf16 need for E experts.
size_t grouped_linear_workspace_bytes(int64_t E);

// y [S, out] fp32 (=, or += when accumulate) x [S, in] bf16 · W_eᵀ, W [E, out, in] bf16.
void grouped_linear_forward_bf16(float* y, const void* x, const void* W, const int32_t* offsets, int64_t S, int64_t E,
                                 int64_t out, int64_t in, bool accumulate, void* workspace);

// dx [S, in] fp32 (=, or += when accumulate) dy [S, out] bf16 · W_e, W [E, out, in] bf16.
void grouped_linear_backward_data_bf16(float* dx, const void* dy, const void* W, const int32_t* offsets, int64_t S,
                                       int64_t E, int64_t out, int64_t in, bool accumulate, void* workspace);

// dW [E, out, in] fp32 += dy_eᵀ · x_e over expert e's rows; dy [S, out], x [S, in] bf16. Rows are
// reduced in ascending order. Needs no workspace.
void grouped_linear_backward_weight_bf16(float* dW, const void* dy, const void* x, const int32_t* offsets, int64_t S,
                                         int64_t E, int64_t out, int64_t in);

// The same with the experts' matrices named by a device array of E pointers instead of one stacked
// buffer (the trainer's parameters are not stacked by expert index): W[e] -> W_e [out, in] bf16,
// 16-byte aligned; dW[e] -> dW_e [out, in] fp32, 8-byte aligned (the caller checks: the kernel cannot).
void grouped_linear_forward_bf16(float* y, const void* x, const void* const* W, const int32_t* offsets, int64_t S,
                                 int64_t E, int64_t out, int64_t in, bool accumulate, void* workspace);
void grouped_linear_backward_data_bf16(float* dx, const void* dy, const void* const* W, const int32_t* offsets,
                                       int64_t S, int64_t E, int64_t out, int64_t in, bool accumulate,
                                       void* workspace);
void grouped_linear_backward_weight_bf16(float* const* dW, const void* dy, const void* x, const int32_t* offsets,
                                         int64_t S, int64_t E, int64_t out, int64_t in);

}  // namespace k3::moe::cuda
