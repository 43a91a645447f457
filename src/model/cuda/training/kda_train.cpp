// The KDA attention block's training forward and backward on the GPU: the twin of
// model/training/kda_block.cpp (the float64 CPU block; same steps, same order), over the fp32 CUDA
// ops of kernels/kda (kda_train_ops_cuda.h, kda_chunk_train_cuda.h).
#ifdef K3_HAVE_CUDA
#include <cmath>

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

kda::cuda::KdaTrainParams core_params(const TrainCtx& t, const KdaTrainTape& tp) {
  kda::cuda::KdaTrainParams p;
  p.q = tp.q, p.k = tp.k, p.v = tp.v, p.g = tp.g, p.beta = tp.beta;
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
  for (float** a : {&tp.qp, &tp.kp, &tp.vp, &tp.qc, &tp.kc, &tp.vc, &tp.qs, &tp.ks, &tp.q, &tp.k, &tp.v, &tp.z, &tp.sg,
                    &tp.g, &tp.o, &tp.gp, &tp.on})
    *a = t.take<float>(N * HD);
  for (float** a : {&tp.q_inv, &tp.k_inv, &tp.beta, &tp.o_inv}) *a = t.take<float>(N * H);
  tp.fa = t.take<float>(N * D);
  {
    const kda::cuda::KdaTrainParams p = core_params(t, tp);
    tp.saved = t.precision == GpuPrecision::BF16 ? t.arena.take_bytes(kda::cuda::kda_chunk_train_bf16_saved_bytes(p))
                                                 : t.arena.take_bytes(kda::cuda::kda_chunk_train_states_bytes(p));
  }

  // 1. q/k/v projections, causal conv + SiLU (v's SiLU output is the recurrence's v).
  train_linear_forward(t, tp.qp, x, N, W.q, tp.x16);
  train_linear_forward(t, tp.kp, x, N, W.k, tp.x16);
  train_linear_forward(t, tp.vp, x, N, W.v, tp.x16);
  const auto& b = t.batch;
  kda::cuda::conv_silu_forward_train(tp.qc, tp.qs, tp.qp, W.qc.w, HD, K, b.cu_seqlens, b.B, N);
  kda::cuda::conv_silu_forward_train(tp.kc, tp.ks, tp.kp, W.kc.w, HD, K, b.cu_seqlens, b.B, N);
  kda::cuda::conv_silu_forward_train(tp.vc, tp.v, tp.vp, W.vc.w, HD, K, b.cu_seqlens, b.B, N);
  // 2. Per-head L2 norm of q and k.
  kda::cuda::l2norm_forward_train(tp.q, tp.q_inv, tp.qs, N * H, D, kL2Eps);
  kda::cuda::l2norm_forward_train(tp.k, tp.k_inv, tp.ks, N * H, D, kL2Eps);
  // 3. beta = sigmoid(b_proj x) (the logits are written into beta, then squashed in place).
  train_linear_forward(t, tp.beta, x, N, W.b, tp.x16);
  kda::cuda::sigmoid_forward_train(tp.beta, tp.beta, N * H);
  // 4. The bounded decay gate.
  train_linear_forward(t, tp.fa, x, N, W.fa, tp.x16);
  train_linear_forward(t, tp.z, tp.fa, N, W.fb);
  kda::cuda::gate_forward_train(tp.g, tp.sg, tp.z, W.alog.w, W.dt.w, c.gate_lower_bound, N, H, D);
  // 5. The chunked recurrence, saving the state entering every chunk.
  {
    const DeviceArena::Mark mark = t.arena.mark();
    const kda::cuda::KdaTrainParams p = core_params(t, tp);
    if (t.precision == GpuPrecision::BF16) {  // bf16 operands on tensor cores, fp32 state
      kda::cuda::kda_chunk_forward_train_bf16(p, tp.o, tp.saved);
    } else {
      void* ws = t.arena.take_bytes(kda::cuda::kda_chunk_forward_train_workspace_bytes(p));
      kda::cuda::kda_chunk_forward_train(p, tp.o, static_cast<float*>(tp.saved), ws);
    }
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
  float *dgp = buf(N * HD), *d_o = buf(N * HD);
  {
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(kda::cuda::gated_rmsnorm_backward_workspace_bytes(N * H, D));
    kda::cuda::gated_rmsnorm_backward_train(d_o, dgp, W.onorm.g, don, tp.o, tp.o_inv, tp.gp, W.onorm.w, N * H, D, ws);
    t.arena.rewind(m);
  }
  train_linear_backward(t, dx, false, dgp, x, N, W.g, tp.x16);

  // 5. The recurrence.
  float *dq = buf(N * HD), *dk = buf(N * HD), *dv = buf(N * HD), *dg = buf(N * HD), *dbeta = buf(N * H);
  {
    const DeviceArena::Mark m = t.arena.mark();
    const kda::cuda::KdaTrainParams p = core_params(t, tp);
    if (t.precision == GpuPrecision::BF16) {
      void* ws = t.arena.take_bytes(kda::cuda::kda_chunk_backward_train_bf16_workspace_bytes(p));
      kda::cuda::kda_chunk_backward_train_bf16(p, d_o, tp.saved, dq, dk, dv, dg, dbeta, ws);
    } else {
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
  kda::cuda::l2norm_backward_train(dq, dq, tp.q, tp.q_inv, N * H, D);
  kda::cuda::l2norm_backward_train(dk, dk, tp.k, tp.k_inv, N * H, D);

  // 1. Conv + SiLU, then the projections.
  float* dp = buf(N * HD);
  void* ws = t.arena.take_bytes(kda::cuda::conv_silu_backward_workspace_bytes(N, HD, K));
  kda::cuda::conv_silu_backward_train(dp, W.qc.g, dq, tp.qc, tp.qp, W.qc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  train_linear_backward(t, dx, true, dp, x, N, W.q, tp.x16);
  kda::cuda::conv_silu_backward_train(dp, W.kc.g, dk, tp.kc, tp.kp, W.kc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  train_linear_backward(t, dx, true, dp, x, N, W.k, tp.x16);
  kda::cuda::conv_silu_backward_train(dp, W.vc.g, dv, tp.vc, tp.vp, W.vc.w, HD, K, b.cu_seqlens, b.B, N, ws);
  train_linear_backward(t, dx, true, dp, x, N, W.v, tp.x16);
  t.arena.rewind(mark);
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
