// KDA attention block on the GPU: the CUDA twin of model/kda_layer.cpp, step for step.
#ifdef K3_HAVE_CUDA
#include <cmath>

#include "core/error.h"
#include "kernels/kda/kda_cuda.h"
#include "model/cuda/cuda_model_impl.h"

namespace k3::gpu {

template <class T>
void kda_attention_forward(Run& r, float* out, const T* x, int64_t N, const std::vector<SegmentDev>& segs,
                           int64_t layer, const KdaDev& w) {
  const K3Config& c = r.c;
  const int64_t H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, K = c.short_conv_kernel_size;
  const bool exact = r.precision == GpuPrecision::F32;
  // Every projection of x̂ at once (one launch for a decode step of a few sequences): q, k, v before their
  // convs, the output gate's pre-activation, the gate's low-rank input and the write strength's pre-activation.
  constexpr DType act = dtype_of<T>();
  T* qp = r.arena.take<T>(N * HD);
  T* kp = r.arena.take<T>(N * HD);
  T* vp = r.arena.take<T>(N * HD);
  T* gp = r.arena.take<T>(N * HD);
  T* fa = r.arena.take<T>(N * D);
  float* beta = r.arena.take<float>(N * H);  // sigmoid applied with the gate below
  linears_of_rows<T>(r, x, N,
                     {{&w.q_proj, qp, act},
                      {&w.k_proj, kp, act},
                      {&w.v_proj, vp, act},
                      {&w.g_proj, gp, act},
                      {&w.f_a_proj, fa, act},
                      {&w.b_proj, beta, DType::F32}});

  T* q = r.arena.take<T>(N * HD);
  T* k = r.arena.take<T>(N * HD);
  T* v = r.arena.take<T>(N * HD);
  const std::vector<SeqGroup> groups = seq_groups(unpooled(r, segs), /*same_length=*/false);
  constexpr float kQkNormEps = 1e-6f;
  if (const PooledDecode* pd = r.pooled) {  // rows 0..B-1: one token of each pooled sequence, the norms fused
    KdaPoolDev& pk = pd->pool->kda[size_t(layer)];
    kda::cuda::conv_qkv_decode({q, k, v}, {qp, kp, vp}, {w.q_conv.data(), w.k_conv.data(), w.v_conv.data()}, int(K),
                               {pk.q_tail.data(), pk.k_tail.data(), pk.v_tail.data()}, pd->slot, pd->B, H, D,
                               kQkNormEps);
  }
  for (const SeqGroup& s : groups) {
    KdaPoolDev& pk = s.first->pool->kda[size_t(layer)];
    const int64_t o = s.row0 * HD, ti = s.first->index * (K - 1) * HD;
    kda::cuda::short_conv_silu(q + o, qp + o, s.B, s.n, HD, w.q_conv.data(), int(K), pk.q_tail.data() + ti);
    kda::cuda::short_conv_silu(k + o, kp + o, s.B, s.n, HD, w.k_conv.data(), int(K), pk.k_tail.data() + ti);
    kda::cuda::short_conv_silu(v + o, vp + o, s.B, s.n, HD, w.v_conv.data(), int(K), pk.v_tail.data() + ti);
  }
  // The pooled decode's rows 0..r0-1 take their gate, beta's sigmoid and the output norm inside the recurrence
  // (KdaGateNorm); the rows after them run those ops on their own.
  const int64_t r0 = r.pooled ? r.pooled->B : 0;
  if (r0 < N) {
    kda::cuda::l2norm_heads(q + r0 * HD, N - r0, H, D, kQkNormEps);
    kda::cuda::l2norm_heads(k + r0 * HD, N - r0, H, D, kQkNormEps);
  }

  // The gate's pre-activation z stays fp32 in both paths: g = -5 sigmoid(e^A (z + dt_bias)) has slope up
  // to 5/4 e^A in z (e^A up to 16 at the reference's init), so a bf16 z (relative error 2^-9) would move
  // g by up to ~0.04 per token, and every such error multiplies the state's decay (e^g) directly.
  float* z = r.arena.take<float>(N * HD);
  float* g = r.arena.take<float>(N * HD);
  linear_f32_out<T>(r, z, fa, N, w.f_b_proj);
  if (r0 < N)
    kda::cuda::gate_forward(g + r0 * HD, z + r0 * HD, w.A_log.data(), w.dt_bias.data(), c.gate_lower_bound, N - r0, H,
                            D, beta + r0 * H);

  // Prefill runs the chunked tensor-core form; decode steps (and anything under one chunk) the fused
  // recurrence. The F32 path always takes the recurrence: plain fp32 FMAs token by token, where the
  // chunked fp32 form splits operands into bf16 pairs (~2^-16 per product, kda_cuda.h), which the
  // fixtures' AttnRes cancellations would amplify past 1e-4 (docs/NUMERICS.md).
  T* o = kp;  // reuses kp
  auto core_params = [&](int64_t row0, int64_t B, int64_t n) {
    kda::cuda::KdaParams p;
    p.B = B, p.T = n, p.H = H, p.D = int(D);
    p.scale = 1.0f / std::sqrt(float(D));
    p.in_dtype = p.out_dtype = dtype_of<T>();
    p.q = q + row0 * HD, p.k = k + row0 * HD, p.v = v + row0 * HD, p.o = o + row0 * HD;
    p.g = g + row0 * HD, p.beta = beta + row0 * H;
    return p;
  };
  if (const PooledDecode* pd = r.pooled) {
    kda::cuda::KdaParams p = core_params(0, pd->B, 1);
    p.state_in = p.state_out = pd->pool->kda[size_t(layer)].state.data();
    p.state_slot = pd->slot;
    kda::cuda::KdaGateNorm f;
    f.z = z, f.A_log = w.A_log.data(), f.dt_bias = w.dt_bias.data(), f.lower_bound = c.gate_lower_bound;
    f.out_gate = gp, f.o_norm = w.o_norm.data(), f.o_eps = float(c.rms_norm_eps);
    kda::cuda::kda_recurrent_forward(p, f);
  }
  for (const SeqGroup& s : groups) {
    float* state = s.first->pool->kda[size_t(layer)].state.data() + s.first->index * H * D * D;
    kda::cuda::KdaParams p = core_params(s.row0, s.B, s.n);
    p.state_in = state, p.state_out = state;
    if (exact || r.reference || s.n < kda::cuda::kChunk) {
      kda::cuda::kda_recurrent_forward(p);
    } else {
      p.workspace_bytes = kda::cuda::kda_chunk_workspace_bytes(s.B, s.n, H, p.in_dtype, D);
      p.workspace = r.arena.take_bytes(p.workspace_bytes);
      kda::cuda::kda_chunk_forward(p);
    }
  }

  if (r0 < N)
    kda::cuda::gated_rmsnorm(o + r0 * HD, o + r0 * HD, gp + r0 * HD, w.o_norm.data(), float(c.rms_norm_eps), N - r0, H,
                             D);
  linear_f32_out<T>(r, out, o, N, w.o_proj);
}

template void kda_attention_forward<float>(Run&, float*, const float*, int64_t, const std::vector<SegmentDev>&, int64_t,
                                           const KdaDev&);
template void kda_attention_forward<bf16>(Run&, float*, const bf16*, int64_t, const std::vector<SegmentDev>&, int64_t,
                                          const KdaDev&);

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
