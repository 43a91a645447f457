// The gated MLA block's training forward and backward on the GPU: the twin of
// model/training/mla_block.cpp (the float64 CPU block; same steps, same order), over the fp32 CUDA
// ops of kernels/mla (mla_train_cuda.h) and kernels/norm (norm_train_cuda.h).
#ifdef K3_HAVE_CUDA
#include <cmath>

#include "core/error.h"
#include "kernels/mla/mla_train_cuda.h"
#include "kernels/mla/mla_train_tc_cuda.h"
#include "kernels/norm/norm_train_cuda.h"
#include "model/cuda/training/train_context.h"
#include "model/tensor_table.h"

namespace k3::gpu {
namespace {

struct MlaShape {
  int64_t D, H, Dn, Dr, Dv, R, Qr, dq, dkv, ldc;
  bool gated;
  mla::Dims core() const { return {H, Dn, Dr, Dv, R}; }
};

MlaShape shape_of(const K3Config& c) {
  MlaShape s{};
  s.D = c.hidden_size, s.H = c.num_attention_heads, s.Dn = c.qk_nope_head_dim, s.Dr = c.qk_rope_head_dim;
  s.Dv = c.v_head_dim, s.R = c.kv_lora_rank, s.Qr = c.q_lora_rank;
  s.dq = s.Dn + s.Dr, s.dkv = s.Dn + s.Dv, s.ldc = s.R + s.Dr;
  s.gated = c.mla_use_output_gate;
  return s;
}

struct MlaParams {
  TrainParam q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, g, o;
};

MlaParams mla_params(const TrainCtx& t, int64_t layer, const MlaShape& s) {
  const std::string prefix = layer_prefix(param_naming(t.params.layout()), layer);
  auto p = [&](TensorKind k) { return t.param(tensor_name_at(prefix, k)); };
  using K = TensorKind;
  MlaParams m;
  if (s.Qr > 0) m.q_a = p(K::MlaQA), m.q_a_norm = p(K::MlaQANorm), m.q_b = p(K::MlaQB);
  else m.q = p(K::MlaQ);
  m.kv_a = p(K::MlaKvA), m.kv_a_norm = p(K::MlaKvANorm), m.kv_b = p(K::MlaKvB), m.o = p(K::MlaO);
  if (s.gated) m.g = p(K::MlaG);
  return m;
}

void rmsnorm_backward(TrainCtx& t, float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy, const float* x,
                      int64_t ldx, const float* rstd, const float* w, int64_t N, int64_t D) {
  const DeviceArena::Mark m = t.arena.mark();
  void* ws = t.arena.take_bytes(norm::cuda::rmsnorm_backward_workspace_bytes(N, D));
  norm::cuda::rmsnorm_backward_train(dx, lddx, dw, dy, lddy, x, ldx, rstd, w, N, D, ws);
  t.arena.rewind(m);
}

}  // namespace

void mla_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out, MlaTrainTape& tp) {
  const MlaShape s = shape_of(t.c);
  const MlaParams W = mla_params(t, layer, s);
  const int64_t N = t.batch.rows;
  const float eps = float(t.c.mla_norm_eps);
  const float scale = float(1.0 / std::sqrt(double(s.dq)));  // q_head_dim^-0.5
  tp.x = x;
  tp.x16 = bf16_operand(t, x, N, t.c.hidden_size);

  // 1. q = q_b(RMSNorm(q_a x)) or q_proj x.
  tp.q = t.take<float>(N * s.H * s.dq);
  if (s.Qr > 0) {
    tp.qa_raw = t.take<float>(N * s.Qr), tp.qa = t.take<float>(N * s.Qr), tp.qa_rstd = t.take<float>(N);
    train_linear_forward(t, tp.qa_raw, x, N, W.q_a, tp.x16);
    norm::cuda::rmsnorm_forward_train(tp.qa, s.Qr, tp.qa_rstd, tp.qa_raw, s.Qr, W.q_a_norm.w, eps, N, s.Qr);
    train_linear_forward(t, tp.q, tp.qa, N, W.q_b);
  } else {
    train_linear_forward(t, tp.q, x, N, W.q, tp.x16);
  }
  // 2. ckv = kv_a x = [c_lat | k_rot]; lat = RMSNorm(c_lat); k_rot stays raw.
  tp.ckv = t.take<float>(N * s.ldc);
  train_linear_forward(t, tp.ckv, x, N, W.kv_a, tp.x16);
  tp.lat = t.take<float>(N * s.R), tp.lat_rstd = t.take<float>(N);
  norm::cuda::rmsnorm_forward_train(tp.lat, s.R, tp.lat_rstd, tp.ckv, s.ldc, W.kv_a_norm.w, eps, N, s.R);
  // 3. kv = kv_b(lat): per head [k_nope | v].
  tp.kv = t.take<float>(N * s.H * s.dkv);
  train_linear_forward(t, tp.kv, tp.lat, N, W.kv_b);
  // 4-5. Causal attention per sequence of the batch.
  const int64_t ldo = s.H * s.Dv;
  tp.o = t.take<float>(N * ldo), tp.lse = t.take<float>(s.H * N);
  const auto& b = t.batch;
  if (t.precision == GpuPrecision::BF16) {  // bf16 operands on tensor cores, packed into scratch
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(mla::cuda::attention_forward_workspace_bytes_bf16(N, s.core()));
    mla::cuda::attention_forward_train_bf16(tp.o, ldo, tp.lse, tp.q, s.H * s.dq, tp.kv, s.H * s.dkv, tp.ckv + s.R,
                                            s.ldc, b.cu_seqlens, b.B, b.max_len, N, s.core(), scale, ws);
    t.arena.rewind(m);
  } else {
    mla::cuda::attention_forward_train(tp.o, ldo, tp.lse, tp.q, s.H * s.dq, tp.kv, s.H * s.dkv, tp.ckv + s.R, s.ldc,
                                       b.cu_seqlens, b.B, b.max_len, N, s.core(), scale);
  }
  // Output gate og = o ⊙ sigmoid(g_proj x), then o_proj.
  if (s.gated) {
    tp.gate = t.take<float>(N * ldo), tp.og = t.take<float>(N * ldo);
    train_linear_forward(t, tp.gate, x, N, W.g, tp.x16);
    mla::cuda::output_gate_forward_train(tp.og, tp.gate, tp.o, N * ldo);
  } else {
    tp.og = tp.o;
  }
  train_linear_forward(t, out, tp.og, N, W.o);
}

void mla_train_backward(TrainCtx& t, int64_t layer, const MlaTrainTape& tp, const float* dy, float* dx) {
  const MlaShape s = shape_of(t.c);
  const MlaParams W = mla_params(t, layer, s);
  const int64_t N = t.batch.rows, ldq = s.H * s.dq, ldkv = s.H * s.dkv, ldo = s.H * s.Dv;
  const float scale = float(1.0 / std::sqrt(double(s.dq)));
  const DeviceArena::Mark mark = t.arena.mark();
  const float* x = tp.x;

  // y = og Woᵀ.
  float* dog = t.take<float>(N * ldo);
  train_linear_backward(t, dog, false, dy, tp.og, N, W.o);
  // Gate: dx is first written here (or by the kv_a term below when ungated).
  float* dO = dog;
  bool dx_written = false;
  if (s.gated) {
    dO = t.take<float>(N * ldo);
    float* dz = t.take<float>(N * ldo);
    mla::cuda::output_gate_backward_train(dO, dz, dog, tp.o, tp.gate, N * ldo);
    train_linear_backward(t, dx, false, dz, x, N, W.g, tp.x16);
    dx_written = true;
  }
  // Attention: dq, dkv and the k_rot columns of dckv (summed over heads); the norm fills columns 0..R.
  float *dq = t.take<float>(N * ldq), *dkv = t.take<float>(N * ldkv), *dckv = t.take<float>(N * s.ldc);
  {
    const auto& b = t.batch;
    const DeviceArena::Mark m = t.arena.mark();
    const bool bf = t.precision == GpuPrecision::BF16;  // bf16 operands on tensor cores
    void* ws = t.arena.take_bytes(bf ? mla::cuda::attention_backward_workspace_bytes_bf16(N, s.core())
                                     : mla::cuda::attention_backward_workspace_bytes(N, s.core()));
    const auto backward = bf ? mla::cuda::attention_backward_train_bf16 : mla::cuda::attention_backward_train;
    backward(dq, ldq, dkv, ldkv, dckv + s.R, s.ldc, dO, ldo, tp.o, tp.q, ldq, tp.kv, ldkv, tp.ckv + s.R, s.ldc, tp.lse,
             b.cu_seqlens, b.B, b.max_len, N, s.core(), scale, ws, /*causal=*/true);
    t.arena.rewind(m);
  }
  // kv = lat Wkvbᵀ; lat = RMSNorm(c_lat); ckv = x Wkvaᵀ.
  float* dlat = t.take<float>(N * s.R);
  train_linear_backward(t, dlat, false, dkv, tp.lat, N, W.kv_b);
  rmsnorm_backward(t, dckv, s.ldc, W.kv_a_norm.g, dlat, s.R, tp.ckv, s.ldc, tp.lat_rstd, W.kv_a_norm.w, N, s.R);
  train_linear_backward(t, dx, dx_written, dckv, x, N, W.kv_a, tp.x16);
  // q path.
  if (s.Qr > 0) {
    float *dqa = t.take<float>(N * s.Qr), *dqa_raw = t.take<float>(N * s.Qr);
    train_linear_backward(t, dqa, false, dq, tp.qa, N, W.q_b);
    rmsnorm_backward(t, dqa_raw, s.Qr, W.q_a_norm.g, dqa, s.Qr, tp.qa_raw, s.Qr, tp.qa_rstd, W.q_a_norm.w, N, s.Qr);
    train_linear_backward(t, dx, true, dqa_raw, x, N, W.q_a, tp.x16);
  } else {
    train_linear_backward(t, dx, true, dq, x, N, W.q, tp.x16);
  }
  t.arena.rewind(mark);
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
