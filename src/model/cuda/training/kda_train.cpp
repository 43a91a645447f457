// The KDA attention block's training forward and backward on the GPU: the twin of
// model/training/kda_block.cpp (the float64 CPU block; same steps, same order), over the CUDA ops of
// kernels/kda (kda_train_ops_cuda.h; the recurrence in kda_chunk_train_cuda.h, fp32, or in
// kda_chunk_train_tc_cuda.h, bf16 tensor cores). In the BF16 mode the recurrence's q, k, v and dO are bf16
// (written so by the ops around it) and its dq, dk, dv come back in bf16: the tensor-core kernels' contract.
#ifdef K3_HAVE_CUDA
#include <cmath>
#include <type_traits>

#include "core/error.h"
#include "kernels/kda/kda_chunk_train_cuda.h"
#include "kernels/kda/kda_chunk_train_tc_cuda.h"
#include "kernels/kda/kda_train_ops_cuda.h"
#include "model/cuda/training/train_context.h"
#include "model/tensor_table.h"

namespace k3::gpu {
namespace {

constexpr float kL2Eps = 1e-6f;  // q/k L2-norm epsilon (kda_block.cpp)

struct KdaParams {
  TrainParam q, k, v, qc, kc, vc, fa, fb, b, g, o, alog, dt, onorm;
};

KdaParams kda_params(const TrainCtx& t, int64_t layer) {
  const std::string prefix = layer_prefix(param_naming(t.params.layout()), layer);
  auto p = [&](TensorKind k) { return t.param(tensor_name_at(prefix, k)); };
  using K = TensorKind;
  return {p(K::KdaQ),  p(K::KdaK), p(K::KdaV), p(K::KdaQConv), p(K::KdaKConv), p(K::KdaVConv),  p(K::KdaFA),
          p(K::KdaFB), p(K::KdaB), p(K::KdaG), p(K::KdaO),     p(K::KdaALog),  p(K::KdaDtBias), p(K::KdaONorm)};
}

// The recurrence's arguments: fp32 q, k, v (T = float) or bf16 (T = uint16_t).
template <class T>
kda::cuda::KdaTrainParamsOf<T> core_params(const TrainCtx& t, const KdaTrainTape& tp) {
  kda::cuda::KdaTrainParamsOf<T> p;
  if constexpr (std::is_same_v<T, float>) p.q = tp.q, p.k = tp.k, p.v = tp.v;
  else p.q = tp.q16, p.k = tp.k16, p.v = tp.v16;
  p.g = tp.g, p.beta = tp.beta;
  p.cu_seqlens = t.batch.cu_seqlens, p.chunk_offsets = t.batch.chunk_offsets;
  p.B = t.batch.B, p.max_len = t.batch.max_len, p.rows = t.batch.rows, p.chunks = t.batch.chunks;
  p.H = int(t.c.kda_num_heads), p.D = int(t.c.kda_head_dim);
  p.scale = float(1.0 / std::sqrt(double(t.c.kda_head_dim)));
  return p;
}

}  // namespace

void kda_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out, KdaTrainTape& tp) {
  const K3Config& c = t.c;
  const KdaParams W = kda_params(t, layer);
  const int64_t N = t.batch.rows, H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D;
  const int K = int(c.short_conv_kernel_size);
  tp.x = x;
  tp.x16 = bf16_operand(t, x, N, c.hidden_size);
  const bool bf16 = t.precision == GpuPrecision::BF16;
  for (float** a :
       {&tp.qp, &tp.kp, &tp.vp, &tp.qc, &tp.kc, &tp.vc, &tp.qs, &tp.ks, &tp.z, &tp.sg, &tp.g, &tp.o, &tp.gp, &tp.on})
    *a = t.take<float>(N * HD);
  tp.q = tp.k = tp.v = nullptr;
  tp.q16 = tp.k16 = tp.v16 = nullptr;
  if (bf16)
    for (uint16_t** a : {&tp.q16, &tp.k16, &tp.v16}) *a = t.take<uint16_t>(N * HD);
  else
    for (float** a : {&tp.q, &tp.k, &tp.v}) *a = t.take<float>(N * HD);
  for (float** a : {&tp.q_inv, &tp.k_inv, &tp.beta, &tp.o_inv}) *a = t.take<float>(N * H);
  tp.fa = t.take<float>(N * D);
  tp.saved = bf16 ? t.arena.take_bytes(kda::cuda::kda_chunk_train_bf16_saved_bytes(core_params<uint16_t>(t, tp)))
                  : t.arena.take_bytes(kda::cuda::kda_chunk_train_states_bytes(core_params<float>(t, tp)));

  // 1. q/k/v projections, causal conv + SiLU (v's SiLU output is the recurrence's v).
  train_linear_forward(t, tp.qp, x, N, W.q, tp.x16);
  train_linear_forward(t, tp.kp, x, N, W.k, tp.x16);
  train_linear_forward(t, tp.vp, x, N, W.v, tp.x16);
  const auto& b = t.batch;
  kda::cuda::conv_silu_forward_train(tp.qc, tp.qs, tp.qp, W.qc.w, HD, K, b.cu_seqlens, b.B, N);
  kda::cuda::conv_silu_forward_train(tp.kc, tp.ks, tp.kp, W.kc.w, HD, K, b.cu_seqlens, b.B, N);
  // 2. Per-head L2 norm of q and k. In BF16 the recurrence's inputs v, q, k are written in bf16 directly.
  if (bf16) {
    kda::cuda::conv_silu_forward_train(tp.vc, tp.v16, tp.vp, W.vc.w, HD, K, b.cu_seqlens, b.B, N);
    kda::cuda::l2norm_forward_train(tp.q16, tp.q_inv, tp.qs, N * H, D, kL2Eps);
    kda::cuda::l2norm_forward_train(tp.k16, tp.k_inv, tp.ks, N * H, D, kL2Eps);
  } else {
    kda::cuda::conv_silu_forward_train(tp.vc, tp.v, tp.vp, W.vc.w, HD, K, b.cu_seqlens, b.B, N);
    kda::cuda::l2norm_forward_train(tp.q, tp.q_inv, tp.qs, N * H, D, kL2Eps);
    kda::cuda::l2norm_forward_train(tp.k, tp.k_inv, tp.ks, N * H, D, kL2Eps);
  }
  // 3. beta = sigmoid(b_proj x) (the logits are written into beta, then squashed in place).
  train_linear_forward(t, tp.beta, x, N, W.b, tp.x16);
  kda::cuda::sigmoid_forward_train(tp.beta, tp.beta, N * H);
  // 4. The bounded decay gate.
  train_linear_forward(t, tp.fa, x, N, W.fa, tp.x16);
  train_linear_forward(t, tp.z, tp.fa, N, W.fb);
  kda::cuda::gate_forward_train(tp.g, tp.sg, tp.z, W.alog.w, W.dt.w, c.gate_lower_bound, N, H, D);
  // 5. The chunked recurrence, saving the state entering every chunk.
  if (bf16) {  // bf16 operands on tensor cores, fp32 state
    kda::cuda::kda_chunk_forward_train_bf16(core_params<uint16_t>(t, tp), tp.o, tp.saved);
  } else {
    const DeviceArena::Mark mark = t.arena.mark();
    const kda::cuda::KdaTrainParams p = core_params<float>(t, tp);
    void* ws = t.arena.take_bytes(kda::cuda::kda_chunk_forward_train_workspace_bytes(p));
    kda::cuda::kda_chunk_forward_train(p, tp.o, static_cast<float*>(tp.saved), ws);
    t.arena.rewind(mark);
  }
  // 6. Gated RMSNorm per head, output projection.
  train_linear_forward(t, tp.gp, x, N, W.g, tp.x16);
  kda::cuda::gated_rmsnorm_forward_train(tp.on, tp.o_inv, tp.o, tp.gp, W.onorm.w, float(c.rms_norm_eps), N * H, D);
  train_linear_forward(t, out, tp.on, N, W.o);
}

void kda_train_backward(TrainCtx& t, int64_t layer, const KdaTrainTape& tp, const float* dy, float* dx) {
  const K3Config& c = t.c;
  const KdaParams W = kda_params(t, layer);
  const int64_t N = t.batch.rows, H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D;
  const int K = int(c.short_conv_kernel_size);
  const auto& b = t.batch;
  const DeviceArena::Mark mark = t.arena.mark();
  const float* x = tp.x;
  auto buf = [&](int64_t n) { return t.take<float>(n); };

  // 6. y = on Woᵀ; the gated norm; gp = g_proj x (the first term of dx, which is overwritten here).
  float* don = buf(N * HD);
  train_linear_backward(t, don, false, dy, tp.on, N, W.o);
  const bool bf16 = t.precision == GpuPrecision::BF16;
  float* dgp = buf(N * HD);
  float* d_o = bf16 ? nullptr : buf(N * HD);
  uint16_t* d_o16 = bf16 ? t.take<uint16_t>(N * HD) : nullptr;
  {
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(kda::cuda::gated_rmsnorm_backward_workspace_bytes(N * H, D));
    if (bf16)
      kda::cuda::gated_rmsnorm_backward_train(d_o16, dgp, W.onorm.g, don, tp.o, tp.o_inv, tp.gp, W.onorm.w, N * H, D,
                                              ws);
    else
      kda::cuda::gated_rmsnorm_backward_train(d_o, dgp, W.onorm.g, don, tp.o, tp.o_inv, tp.gp, W.onorm.w, N * H, D, ws);
    t.arena.rewind(m);
  }
  train_linear_backward(t, dx, false, dgp, x, N, W.g, tp.x16);

  // 5. The recurrence (in BF16: bf16 dq, dk, dv, widened by the L2-norm backward and the conv's).
  float *dq = buf(N * HD), *dk = buf(N * HD), *dg = buf(N * HD), *dbeta = buf(N * H);
  float* dv = bf16 ? nullptr : buf(N * HD);
  uint16_t *dq16 = nullptr, *dk16 = nullptr, *dv16 = nullptr;
  if (bf16)
    for (uint16_t** a : {&dq16, &dk16, &dv16}) *a = t.take<uint16_t>(N * HD);
  {
    const DeviceArena::Mark m = t.arena.mark();
    if (bf16) {
      const kda::cuda::KdaTrainBf16Params p = core_params<uint16_t>(t, tp);
      void* ws = t.arena.take_bytes(kda::cuda::kda_chunk_backward_train_bf16_workspace_bytes(p));
      kda::cuda::kda_chunk_backward_train_bf16(p, d_o16, tp.saved, dq16, dk16, dv16, dg, dbeta, ws);
    } else {
      const kda::cuda::KdaTrainParams p = core_params<float>(t, tp);
      void* ws = t.arena.take_bytes(kda::cuda::kda_chunk_backward_train_workspace_bytes(p));
      kda::cuda::kda_chunk_backward_train(p, d_o, static_cast<const float*>(tp.saved), dq, dk, dv, dg, dbeta, ws);
    }
    t.arena.rewind(m);
  }

  // 4. Gate, then z = fa Wfbᵀ, fa = x Wfaᵀ.
  float *dz = buf(N * HD), *dfa = buf(N * D);
  {
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(kda::cuda::gate_backward_workspace_bytes(N, H, D));
    kda::cuda::gate_backward_train(dz, W.alog.g, W.dt.g, dg, tp.sg, tp.z, W.alog.w, W.dt.w, c.gate_lower_bound, N, H, D,
                                   ws);
    t.arena.rewind(m);
  }
  train_linear_backward(t, dfa, false, dz, tp.fa, N, W.fb);
  train_linear_backward(t, dx, true, dfa, x, N, W.fa, tp.x16);

  // 3. beta = sigmoid(b_proj x).
  kda::cuda::sigmoid_backward_train(dbeta, dbeta, tp.beta, N * H);
  train_linear_backward(t, dx, true, dbeta, x, N, W.b, tp.x16);

  // 2. L2 norms (in place: dq, dk become the gradients of the SiLU outputs).
  if (bf16) {
    kda::cuda::l2norm_backward_train(dq, dq16, tp.q16, tp.q_inv, N * H, D);
    kda::cuda::l2norm_backward_train(dk, dk16, tp.k16, tp.k_inv, N * H, D);
  } else {
    kda::cuda::l2norm_backward_train(dq, dq, tp.q, tp.q_inv, N * H, D);
    kda::cuda::l2norm_backward_train(dk, dk, tp.k, tp.k_inv, N * H, D);
  }

  // 1. Conv + SiLU, then the projections.
  float* dp = buf(N * HD);
  void* ws = t.arena.take_bytes(kda::cuda::conv_silu_backward_workspace_bytes(N, HD, K));
  kda::cuda::conv_silu_backward_train(dp, W.qc.g, dq, tp.qc, tp.qp, W.qc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  train_linear_backward(t, dx, true, dp, x, N, W.q, tp.x16);
  kda::cuda::conv_silu_backward_train(dp, W.kc.g, dk, tp.kc, tp.kp, W.kc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  train_linear_backward(t, dx, true, dp, x, N, W.k, tp.x16);
  if (bf16)
    kda::cuda::conv_silu_backward_train(dp, W.vc.g, dv16, tp.vc, tp.vp, W.vc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  else kda::cuda::conv_silu_backward_train(dp, W.vc.g, dv, tp.vc, tp.vp, W.vc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  train_linear_backward(t, dx, true, dp, x, N, W.v, tp.x16);
  t.arena.rewind(mark);
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
