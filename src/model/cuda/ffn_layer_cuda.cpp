// FFN blocks on the GPU: the CUDA twin of model/ffn_layer.cpp. Dense SiTU-GLU MLP, and Stable
// LatentMoE: fp32 sigmoid router on the full-width x̂ with biased top-k, latent down-projection,
// routed experts, fp32 weighted sum, RMSNorm of the aggregate, up-projection, plus shared experts.
//   BF16 path: device dispatch + the grouped GEMMs with SiTU fused (moe_cuda.h), no host round trip.
//   F32 path: the routing comes to the host and each chosen expert runs as exact GEMMs on its
//             gathered rows, experts in ascending order, so every token's aggregate sums in the
//             CPU's order.
#ifdef K3_HAVE_CUDA
#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/ffn/glu_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/moe/expert_rows_cuda.h"
#include "kernels/norm/norm_cuda.h"
#include "model/cuda/cuda_model_impl.h"

namespace k3::gpu {

namespace {

// out[N, down.rows] fp32 = down( act(g, u) ) from g = gate x and u = up x [N, I] (g is overwritten).
// With accumulate, out += that instead (out is read).
template <class T>
void glu_down(Run& r, float* out, T* g, const T* u, int64_t N, const GluDev& w, bool accumulate = false) {
  const int64_t I = w.gate_proj.rows;
  ffn::cuda::GluLaunch gl;
  gl.out = g, gl.out_type = dtype_of<T>(), gl.gate = g, gl.up = u, gl.in_type = dtype_of<T>();
  gl.rows = N, gl.cols = I, gl.act = glu_params(r.c);
  ffn::cuda::glu_forward(gl);
  linear<T>(r, out, DType::F32, w.down_proj.rows, g, I, N, w.down_proj, accumulate);
}

// out[N, down.rows] fp32 = down( act(gate x, up x) ).
template <class T>
void glu_mlp(Run& r, float* out, const T* x, int64_t N, const GluDev& w) {
  const int64_t I = w.gate_proj.rows;
  T* g = r.arena.take<T>(N * I);
  T* u = r.arena.take<T>(N * I);
  linears_of_rows<T>(r, x, N, {{&w.gate_proj, g, dtype_of<T>()}, {&w.up_proj, u, dtype_of<T>()}});
  glu_down<T>(r, out, g, u, N, w);
}

// The F32 path's routed experts: u [N, lat] = Σ_k w[t,k] expert_{idx[t,k]}(z[t]).
void experts_exact(Run& r, float* u, const float* z, const int32_t* idx_dev, const float* wt_dev, int64_t N,
                   const MoeDev& w) {
  const K3Config& c = r.c;
  const int64_t E = c.num_experts, K = c.num_experts_per_token, lat = c.routed_expert_hidden_size;
  const int64_t I = w.w1.rows;
  std::vector<int32_t> idx(size_t(N * K));
  std::vector<float> wt(size_t(N * K));
  cuda::copy_to_host(idx.data(), idx_dev, idx.size() * 4);
  cuda::copy_to_host(wt.data(), wt_dev, wt.size() * 4);
  // Rows grouped by expert (ascending), tokens ascending within an expert: the CPU's order.
  std::vector<int64_t> count(size_t(E) + 1, 0);
  for (int32_t e : idx) {
    K3_CHECK(e >= 0 && e < E, "GPU MoE: router chose expert ", e, " of ", E);
    ++count[size_t(e) + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[size_t(e) + 1] += count[size_t(e)];
  std::vector<int32_t> tok(idx.size());
  std::vector<float> a(idx.size());
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = idx[size_t(t * K + k)], at = fill[size_t(e)]++;
      tok[size_t(at)] = int32_t(t);
      a[size_t(at)] = wt[size_t(t * K + k)];
    }
  int32_t* tok_dev = r.arena.take<int32_t>(N * K);
  float* a_dev = r.arena.take<float>(N * K);
  cuda::copy_to_device(tok_dev, tok.data(), tok.size() * 4);
  cuda::copy_to_device(a_dev, a.data(), a.size() * 4);

  const int64_t maxn = N;  // an expert gets each token at most once
  float* zin = r.arena.take<float>(maxn * lat);
  float* g = r.arena.take<float>(maxn * I);
  float* up = r.arena.take<float>(maxn * I);
  float* y = r.arena.take<float>(maxn * lat);
  cuda::zero_on_device(u, size_t(N * lat) * 4);
  const GluParams gp = glu_params(c);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = count[size_t(e)], ne = count[size_t(e) + 1] - r0;
    if (ne == 0) continue;
    elementwise::cuda::gather_rows(zin, z, tok_dev + r0, ne, lat);
    gemm::cuda::linear_exact(r.gemm, g, I, zin, lat, w.w1.expert_f64(e), ne, I, lat);
    gemm::cuda::linear_exact(r.gemm, up, I, zin, lat, w.w3.expert_f64(e), ne, I, lat);
    ffn::cuda::glu_forward(g, g, up, ne * I, gp);
    gemm::cuda::linear_exact(r.gemm, y, lat, g, I, w.w2.expert_f64(e), ne, lat, I);
    elementwise::cuda::scatter_add_rows(u, y, tok_dev + r0, a_dev + r0, ne, lat);
  }
}

}  // namespace

template <class T>
void dense_ffn_forward(Run& r, float* out, const T* x, int64_t N, const GluDev& w) {
  glu_mlp<T>(r, out, x, N, w);
}

template <class T>
void moe_ffn_forward(Run& r, float* out, const T* x, int64_t N, int64_t layer, const MoeDev& w) {
  const K3Config& c = r.c;
  const int64_t E = c.num_experts, K = c.num_experts_per_token, lat = c.routed_expert_hidden_size;

  // Every projection of x̂ at once (one launch for a decode step of a few sequences): the router's logits, the
  // latent down-projection, and the shared experts' gate and up.
  constexpr DType act = dtype_of<T>();
  const int64_t Ish = w.shared.empty() ? 0 : w.shared.gate_proj.rows;
  float* logits = r.arena.take<float>(N * E);
  T* z = r.arena.take<T>(N * lat);
  T* sg = w.shared.empty() ? nullptr : r.arena.take<T>(N * Ish);
  T* su = w.shared.empty() ? nullptr : r.arena.take<T>(N * Ish);
  linears_of_rows<T>(r, x, N,
                     {{&w.router, logits, DType::F32},
                      {&w.latent_down, z, act},
                      {&w.shared.gate_proj, sg, act},
                      {&w.shared.up_proj, su, act}});
  int32_t* idx = r.arena.take<int32_t>(N * K);
  float* wt = r.arena.take<float>(N * K);
  moe::cuda::router_forward(idx, wt, logits, w.router_bias.data(), N, router_params(c));
  if (r.hooks && r.hooks->topk) {
    std::vector<int32_t> h(size_t(N * K));
    cuda::copy_to_host(h.data(), idx, h.size() * 4);
    r.hooks->topk(layer, h.data(), N, K);
  }

  if constexpr (std::is_same_v<T, float>) {
    float* u = r.arena.take<float>(N * lat);  // fp32 aggregate of the routed experts
    experts_exact(r, u, z, idx, wt, N, w);
    if (c.latent_moe_use_norm) norm::cuda::rmsnorm_forward(u, u, w.latent_norm.data(), float(c.rms_norm_eps), N, lat);
    linear_f32_out<T>(r, out, u, N, w.latent_up);
  } else {
    // The routed experts: a decode step of a few sequences runs each slot's expert as rows, in slot order and
    // without a plan (moe/expert_rows_cuda.h); any other step sorts the slots by expert for the grouped GEMMs.
    // Then their weighted sum and the latent norm in one launch, which writes the bf16 rows latent_up reads (the
    // bits of an fp32 norm, then a conversion).
    const moe::cuda::ExpertLinear w1 = w.w1.linear(), w3 = w.w3.linear(), w2 = w.w2.linear();
    bf16* h = r.arena.take<bf16>(N * K * w.w1.rows);
    bf16* y = r.arena.take<bf16>(N * K * lat);
    const int32_t* slot_of = nullptr;  // slot order
    if (takes_linear_rows(r, N) && moe::cuda::expert_rows_can_run(w1, w3, w2, N, K).empty()) {
      moe::cuda::expert_rows_forward(h, y, z, idx, N, K, w1, w3, w2, glu_params(c));
    } else {
      r.dispatch->build(idx, N);
      moe::cuda::expert_gate_up(h, z, *r.dispatch, w1, w3, glu_params(c));
      moe::cuda::expert_down(y, h, *r.dispatch, w2);
      slot_of = r.dispatch->slot_of();
    }
    bf16* u16 = r.arena.take<bf16>(N * lat);
    if (c.latent_moe_use_norm) {
      moe::cuda::combine_rmsnorm(u16, y, wt, N, K, lat, slot_of, w.latent_norm.data(), float(c.rms_norm_eps));
    } else {
      float* u = r.arena.take<float>(N * lat);
      moe::cuda::combine(u, y, wt, N, K, lat, slot_of);
      gemm::cuda::convert_f32_to_bf16(u16, u, N * lat);
    }
    linear_f32_out<T>(r, out, u16, N, w.latent_up);
  }
  // The shared experts' down-projection adds into out as it stores (fp32 acc + out, rounded once, as out + sh
  // was; linear_rows or the GEMM's epilogue): one launch fewer.
  if (!w.shared.empty()) glu_down<T>(r, out, sg, su, N, w.shared, /*accumulate=*/true);
}

template void dense_ffn_forward<float>(Run&, float*, const float*, int64_t, const GluDev&);
template void dense_ffn_forward<bf16>(Run&, float*, const bf16*, int64_t, const GluDev&);
template void moe_ffn_forward<float>(Run&, float*, const float*, int64_t, int64_t, const MoeDev&);
template void moe_ffn_forward<bf16>(Run&, float*, const bf16*, int64_t, int64_t, const MoeDev&);

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
