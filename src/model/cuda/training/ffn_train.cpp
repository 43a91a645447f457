// The FFN blocks' training forward and backward on the GPU: the GLU MLP (dense layer, shared
// experts) and Stable LatentMoE, twins of model/training/ffn_block.cpp (same steps, same order),
// over kernels/ffn (glu), kernels/moe (moe_train_cuda.h: router, dispatch, combine) and kernels/norm.
// The routed experts' linears: in the BF16 mode one grouped GEMM per linear over all experts
// (kernels/moe/expert_gemm_train_cuda.h); in the F32 mode one pedantic fp32 cuBLAS call per expert on
// the rows routed to it (train_linear_*).
#ifdef K3_HAVE_CUDA
#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/ffn/glu_cuda.h"
#include "kernels/ffn/glu_train_cuda.h"
#include "kernels/moe/expert_gemm_train_cuda.h"
#include "kernels/moe/moe_train_cuda.h"
#include "kernels/norm/norm_train_cuda.h"
#include "model/cuda/training/train_context.h"
#include "model/layers.h"
#include "model/tensor_table.h"

namespace k3::gpu {

// ---- GLU MLP ------------------------------------------------------------------------------------
void glu_train_forward(TrainCtx& t, const TrainParam& gate, const TrainParam& up, const TrainParam& down,
                       const float* x, int64_t N, float* out, GluTrainTape& tp, const uint16_t* x16) {
  const int64_t I = gate.rows;
  tp.x = x, tp.N = N, tp.I = I;
  tp.x16 = x16 ? x16 : bf16_operand(t, x, N, gate.cols);
  tp.g = t.take<float>(N * I), tp.u = t.take<float>(N * I), tp.h = t.take<float>(N * I);
  train_linear_forward(t, tp.g, x, N, gate, tp.x16);
  train_linear_forward(t, tp.u, x, N, up, tp.x16);
  ffn::cuda::glu_forward(tp.h, tp.g, tp.u, N * I, glu_params(t.c));
  train_linear_forward(t, out, tp.h, N, down);
}

void glu_train_backward(TrainCtx& t, const TrainParam& gate, const TrainParam& up, const TrainParam& down,
                        const GluTrainTape& tp, const float* dy, float* dx) {
  const DeviceArena::Mark mark = t.arena.mark();
  const int64_t N = tp.N, I = tp.I;
  float *dg = t.take<float>(N * I), *du = t.take<float>(N * I);
  train_linear_backward(t, dg, false, dy, tp.h, N, down);  // dg holds dh
  ffn::cuda::glu_backward_train(dg, du, dg, tp.g, tp.u, N * I, glu_params(t.c));
  train_linear_backward(t, dx, false, dg, tp.x, N, gate, tp.x16);
  train_linear_backward(t, dx, true, du, tp.x, N, up, tp.x16);
  t.arena.rewind(mark);
}

namespace {
struct GluNames {
  TrainParam gate, up, down;
};
GluNames glu_at(const TrainCtx& t, int64_t layer, TensorKind g, TensorKind u, TensorKind d, int64_t expert = -1) {
  const std::string prefix = layer_prefix(param_naming(t.params.layout()), layer);
  return {t.param(tensor_name_at(prefix, g, expert)), t.param(tensor_name_at(prefix, u, expert)),
          t.param(tensor_name_at(prefix, d, expert))};
}
}  // namespace

void dense_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out, GluTrainTape& tp) {
  const GluNames w = glu_at(t, layer, TensorKind::DenseGate, TensorKind::DenseUp, TensorKind::DenseDown);
  glu_train_forward(t, w.gate, w.up, w.down, x, t.batch.rows, out, tp);
}
void dense_train_backward(TrainCtx& t, int64_t layer, const GluTrainTape& tp, const float* dy, float* dx) {
  const GluNames w = glu_at(t, layer, TensorKind::DenseGate, TensorKind::DenseUp, TensorKind::DenseDown);
  glu_train_backward(t, w.gate, w.up, w.down, tp, dy, dx);
}

// ---- Stable LatentMoE ---------------------------------------------------------------------------
struct MoeTrainTape {
  const float* x = nullptr;
  const uint16_t* x16 = nullptr;  // BF16 mode: x's bf16 copy (router, latent down, shared experts)
  int64_t N = 0, E = 0, K = 0, L = 0, I = 0;
  moe::cuda::TrainDispatch* dispatch = nullptr;  // owned by the model (reused across steps)
  int32_t* idx = nullptr;                        // [N, K]
  float *weight = nullptr, *scores = nullptr, *sel_sum = nullptr;
  float* z = nullptr;                                            // [N, L] latent
  float* zs = nullptr;                                           // [S, L] latent rows sorted by expert (S = N·K)
  float *ge = nullptr, *ue = nullptr, *he = nullptr;             // [S, I] experts' GLU
  float* ye = nullptr;                                           // [S, L] experts' outputs
  const ExpertTables* tables = nullptr;                          // set: the experts ran as grouped GEMMs
  const uint16_t *zs16 = nullptr, *he16 = nullptr;               // BF16 mode: bf16 zs and he (GEMM operands)
  float *agg = nullptr, *agg_rstd = nullptr, *normed = nullptr;  // [N, L], [N], [N, L]
  bool has_shared = false;
  GluTrainTape shared;
};

void MoeTapeDeleter::operator()(MoeTrainTape* p) const { delete p; }
const float* moe_router_scores(const MoeTrainTape& tape) { return tape.scores; }

namespace {
struct MoeParams {
  TrainParam router, down, up, norm;
  std::vector<GluNames> experts;
  GluNames shared;
};
// with_experts: also the routed experts' names (E x 3 lookups; the BF16 mode reads its tables instead).
MoeParams moe_params(const TrainCtx& t, int64_t layer, bool with_experts = true) {
  const std::string prefix = layer_prefix(param_naming(t.params.layout()), layer);
  auto p = [&](TensorKind k) { return t.param(tensor_name_at(prefix, k)); };
  MoeParams m;
  m.router = p(TensorKind::MoeRouter), m.down = p(TensorKind::MoeLatentDown), m.up = p(TensorKind::MoeLatentUp);
  if (t.c.latent_moe_use_norm) m.norm = p(TensorKind::MoeLatentNorm);
  for (int64_t e = 0; with_experts && e < t.c.num_experts; ++e)
    m.experts.push_back(glu_at(t, layer, TensorKind::ExpertGate, TensorKind::ExpertUp, TensorKind::ExpertDown, e));
  if (t.c.num_shared_experts > 0)
    m.shared = glu_at(t, layer, TensorKind::SharedGate, TensorKind::SharedUp, TensorKind::SharedDown);
  return m;
}
}  // namespace

std::unique_ptr<ExpertTables> make_expert_tables(const TrainCtx& t, int64_t layer) {
  const MoeParams W = moe_params(t, layer);
  const int64_t I = t.c.moe_intermediate_size, L = t.c.routed_expert_hidden_size;
  for (const GluNames& e : W.experts)
    K3_CHECK(e.gate.rows == I && e.gate.cols == L && e.up.rows == I && e.up.cols == L && e.down.rows == L &&
                 e.down.cols == I,
             "GPU training: layer ", layer, "'s routed experts are not [", I, ", ", L, "] / [", L, ", ", I, "]");
  // The grouped kernels take out/in in whole 16-byte chunks of bf16.
  if (I % 8 != 0 || L % 8 != 0) return nullptr;
  auto tables = std::make_unique<ExpertTables>();
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  for (int k = 0; k < 3; ++k) {
    std::vector<const void*> w;
    std::vector<float*> g;
    for (const GluNames& e : W.experts) {
      const TrainParam& p = k == 0 ? e.gate : k == 1 ? e.up : e.down;
      K3_CHECK(p.w16 != nullptr, "GPU training: expert tables need the BF16 mode's weight copy");
      // The grouped kernels load 16-byte chunks: a tensor off that grid (the flat layout puts a
      // tensor wherever the previous ones end, e.g. after a 4-head A_log) keeps the per-expert path.
      if (!aligned(p.w16, 16) || !aligned(p.g, 8)) return nullptr;
      w.push_back(p.w16), g.push_back(p.g);
    }
    tables->w16[k] = cuda::DeviceBuffer<const void*>(w.data(), w.size());
    tables->g[k] = cuda::DeviceBuffer<float*>(g.data(), g.size());
  }
  return tables;
}

namespace {
// Mean rows per expert from which one cuBLAS call per expert beats the grouped kernels: with few rows
// per expert (k3-1b's ~170 rows of 256 x 256) a launch per expert is all overhead and the grouped
// kernels win by far; with many (K3's experts, ~500 rows and up) cuBLAS's kernels run near their
// ceiling and the loop is faster over a linear's three GEMMs (docs/BENCHMARKS.md,
// bench_cuda_train_expert_gemm; the crossover between is not placed).
constexpr int64_t kPerExpertCublasRows = 1024;

// Rows [r0, ...) of a sorted operand's bf16 copy of `width` columns (null in the F32 mode).
const uint16_t* rows16(const uint16_t* x16, int64_t r0, int64_t width) { return x16 ? x16 + r0 * width : nullptr; }
}  // namespace

std::unique_ptr<MoeTrainTape, MoeTapeDeleter> moe_train_forward(TrainCtx& t, int64_t layer, const float* x, float* out,
                                                                const float* router_bias, const int32_t* forced,
                                                                moe::cuda::TrainDispatch& dispatch,
                                                                const ExpertTables* experts) {
  const K3Config& c = t.c;
  const int64_t N = t.batch.rows, E = c.num_experts, K = c.num_experts_per_token, L = c.routed_expert_hidden_size;
  const int64_t S = N * K;
  if (t.batch_invariant && !experts)
    fail("batch-invariant GPU training: layer ", layer,
         "'s routed experts are off the grouped GEMMs' grid (dimensions multiples of 8, 16-byte aligned in the flat "
         "parameter layout); this config cannot train batch-invariant");
  // Many rows per expert: one cuBLAS call each (not batch-invariant: cuBLAS's kernel depends on the rows).
  if (S >= kPerExpertCublasRows * E && !t.batch_invariant) experts = nullptr;
  const MoeParams W = moe_params(t, layer, experts == nullptr);
  std::unique_ptr<MoeTrainTape, MoeTapeDeleter> owned(new MoeTrainTape);
  MoeTrainTape& tp = *owned;
  tp.x = x, tp.N = N, tp.E = E, tp.K = K, tp.L = L, tp.dispatch = &dispatch;
  tp.x16 = bf16_operand(t, x, N, c.hidden_size);

  // 1. Router on the full-width x̂ (the logits are scratch).
  tp.idx = t.take<int32_t>(N * K), tp.weight = t.take<float>(N * K), tp.scores = t.take<float>(N * E);
  tp.sel_sum = t.take<float>(N);
  {
    const DeviceArena::Mark m = t.arena.mark();
    float* logits = t.take<float>(N * E);
    train_linear_forward(t, logits, x, N, W.router, tp.x16);
    moe::cuda::router_forward_train(tp.idx, tp.weight, tp.scores, tp.sel_sum, logits, router_bias, N, router_params(c));
    if (forced) moe::cuda::router_force_train(tp.idx, tp.weight, tp.sel_sum, tp.scores, forced, N, router_params(c));
    t.arena.rewind(m);
  }
  // 2. Latent down-projection.
  tp.z = t.take<float>(N * L);
  train_linear_forward(t, tp.z, x, N, W.down, tp.x16);
  // 3. Each expert on the rows routed to it (sorted by expert), then the weighted sum in slot order.
  dispatch.build(tp.idx, N);
  const std::vector<int64_t>& off = dispatch.offsets();
  tp.zs = t.take<float>(S * L);
  moe::cuda::gather_sorted_rows(tp.zs, tp.z, dispatch, L);
  tp.I = c.moe_intermediate_size;
  const int64_t I = tp.I;
  tp.ge = t.take<float>(S * I), tp.ue = t.take<float>(S * I), tp.he = t.take<float>(S * I);
  tp.ye = t.take<float>(S * L);
  tp.tables = experts;
  tp.zs16 = bf16_operand(t, tp.zs, S, L);  // the operand of both the gate and up linears
  if (experts) {
    const int32_t* offd = dispatch.offsets_device();
    {
      const DeviceArena::Mark m = t.arena.mark();
      void* ws = t.arena.take_bytes(moe::cuda::grouped_linear_workspace_bytes(E));
      moe::cuda::grouped_linear_forward_bf16(tp.ge, tp.zs16, experts->w16[0].data(), offd, S, E, I, L, false, ws);
      moe::cuda::grouped_linear_forward_bf16(tp.ue, tp.zs16, experts->w16[1].data(), offd, S, E, I, L, false, ws);
      t.arena.rewind(m);
    }
    ffn::cuda::glu_forward(tp.he, tp.ge, tp.ue, S * I, glu_params(c));
    tp.he16 = bf16_operand(t, tp.he, S, I);
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(moe::cuda::grouped_linear_workspace_bytes(E));
    moe::cuda::grouped_linear_forward_bf16(tp.ye, tp.he16, experts->w16[2].data(), offd, S, E, L, I, false, ws);
    t.arena.rewind(m);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[size_t(e)], n = off[size_t(e) + 1] - r0;
      if (n == 0) continue;
      const uint16_t* zs16 = rows16(tp.zs16, r0, L);
      train_linear_forward(t, tp.ge + r0 * I, tp.zs + r0 * L, n, W.experts[size_t(e)].gate, zs16);
      train_linear_forward(t, tp.ue + r0 * I, tp.zs + r0 * L, n, W.experts[size_t(e)].up, zs16);
    }
    ffn::cuda::glu_forward(tp.he, tp.ge, tp.ue, S * I, glu_params(c));
    tp.he16 = bf16_operand(t, tp.he, S, I);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[size_t(e)], n = off[size_t(e) + 1] - r0;
      if (n == 0) continue;
      train_linear_forward(t, tp.ye + r0 * L, tp.he + r0 * I, n, W.experts[size_t(e)].down, rows16(tp.he16, r0, I));
    }
  }
  tp.agg = t.take<float>(N * L);
  moe::cuda::combine_forward_train(tp.agg, tp.ye, tp.weight, dispatch, N, L);
  // RMSNorm of the aggregate.
  tp.normed = tp.agg;
  if (c.latent_moe_use_norm) {
    tp.normed = t.take<float>(N * L), tp.agg_rstd = t.take<float>(N);
    norm::cuda::rmsnorm_forward_train(tp.normed, L, tp.agg_rstd, tp.agg, L, W.norm.w, float(c.rms_norm_eps), N, L);
  }
  // 5. Up-projection, plus the shared experts on x̂.
  train_linear_forward(t, out, tp.normed, N, W.up);
  tp.has_shared = c.num_shared_experts > 0;
  if (tp.has_shared) {
    float* sh = t.take<float>(N * c.hidden_size);
    glu_train_forward(t, W.shared.gate, W.shared.up, W.shared.down, x, N, sh, tp.shared, tp.x16);
    elementwise::cuda::add_inplace(out, sh, N * c.hidden_size);
  }
  return owned;
}

void moe_train_backward(TrainCtx& t, int64_t layer, const MoeTrainTape& tp, const float* dy, float* dx) {
  const K3Config& c = t.c;
  const MoeParams W = moe_params(t, layer, tp.tables == nullptr);
  const int64_t N = tp.N, E = tp.E, K = tp.K, L = tp.L, I = tp.I, S = N * K, D = c.hidden_size;
  const moe::cuda::TrainDispatch& dispatch = *tp.dispatch;
  const std::vector<int64_t>& off = dispatch.offsets();
  const DeviceArena::Mark mark = t.arena.mark();

  // Shared experts: dx is first written here.
  if (tp.has_shared) glu_train_backward(t, W.shared.gate, W.shared.up, W.shared.down, tp.shared, dy, dx);
  else cuda::zero_on_device(dx, size_t(N * D) * sizeof(float));

  // y = normed W↑ᵀ; the norm of the aggregate.
  float* du = t.take<float>(N * L);
  train_linear_backward(t, du, false, dy, tp.normed, N, W.up);
  if (c.latent_moe_use_norm) {
    float* dagg = t.take<float>(N * L);
    const DeviceArena::Mark m = t.arena.mark();
    void* ws = t.arena.take_bytes(norm::cuda::rmsnorm_backward_workspace_bytes(N, L));
    norm::cuda::rmsnorm_backward_train(dagg, L, W.norm.g, du, L, tp.agg, L, tp.agg_rstd, W.norm.w, N, L, ws);
    t.arena.rewind(m);
    du = dagg;
  }
  // u = Σ_k w_k y_{e_k}: the experts' output gradients and the mixture weights' gradient.
  float *dye = t.take<float>(S * L), *dweight = t.take<float>(N * K);
  moe::cuda::combine_backward_train(dye, dweight, du, tp.ye, tp.weight, dispatch, N, L);
  // Experts: down, the GLU, then gate/up into the sorted latent rows' gradient.
  float *dge = t.take<float>(S * I), *due = t.take<float>(S * I), *dzs = t.take<float>(S * L);
  if (const ExpertTables* x = tp.tables) {
    const int32_t* offd = dispatch.offsets_device();
    void* ws = t.arena.take_bytes(moe::cuda::grouped_linear_workspace_bytes(E));
    const uint16_t* dye16 = to_bf16(t, dye, L, S, L);
    moe::cuda::grouped_linear_backward_weight_bf16(x->g[2].data(), dye16, tp.he16, offd, S, E, L, I);
    moe::cuda::grouped_linear_backward_data_bf16(dge, dye16, x->w16[2].data(), offd, S, E, L, I, false, ws);
    ffn::cuda::glu_backward_train(dge, due, dge, tp.ge, tp.ue, S * I, glu_params(c));
    const uint16_t *dge16 = to_bf16(t, dge, I, S, I), *due16 = to_bf16(t, due, I, S, I);
    moe::cuda::grouped_linear_backward_weight_bf16(x->g[0].data(), dge16, tp.zs16, offd, S, E, I, L);
    moe::cuda::grouped_linear_backward_weight_bf16(x->g[1].data(), due16, tp.zs16, offd, S, E, I, L);
    moe::cuda::grouped_linear_backward_data_bf16(dzs, dge16, x->w16[0].data(), offd, S, E, I, L, false, ws);
    moe::cuda::grouped_linear_backward_data_bf16(dzs, due16, x->w16[1].data(), offd, S, E, I, L, true, ws);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[size_t(e)], n = off[size_t(e) + 1] - r0;
      if (n == 0) continue;
      train_linear_backward(t, dge + r0 * I, false, dye + r0 * L, tp.he + r0 * I, n, W.experts[size_t(e)].down,
                            rows16(tp.he16, r0, I));
    }
    ffn::cuda::glu_backward_train(dge, due, dge, tp.ge, tp.ue, S * I, glu_params(c));
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[size_t(e)], n = off[size_t(e) + 1] - r0;
      if (n == 0) continue;
      const uint16_t* zs16 = rows16(tp.zs16, r0, L);
      train_linear_backward(t, dzs + r0 * L, false, dge + r0 * I, tp.zs + r0 * L, n, W.experts[size_t(e)].gate, zs16);
      train_linear_backward(t, dzs + r0 * L, true, due + r0 * I, tp.zs + r0 * L, n, W.experts[size_t(e)].up, zs16);
    }
  }
  float* dz = t.take<float>(N * L);
  moe::cuda::scatter_sorted_rows(dz, dzs, dispatch, N, L);
  // z = x W↓ᵀ.
  train_linear_backward(t, dx, true, dz, tp.x, N, W.down, tp.x16);
  // Router: through the renormalised weights and the sigmoid into the logits.
  float* dlogits = t.take<float>(N * E);
  moe::cuda::router_backward_train(dlogits, dweight, tp.scores, tp.idx, tp.sel_sum, N, router_params(c));
  train_linear_backward(t, dx, true, dlogits, tp.x, N, W.router, tp.x16);
  t.arena.rewind(mark);
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
