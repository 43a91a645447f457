// The GPU training backend of the decoder schedule (model/decoder.h) and CudaTrainModel
// (cuda_train_model.h). The twin of model/training/model_train.cpp's TrainBackend: the same handles
// (node ids: every version of the running block sum is a node with its own gradient buffer, because
// AttnRes mixes snapshots of that sum) over device buffers from the step's arena.
#ifdef K3_HAVE_CUDA
#include "model/cuda/training/cuda_train_model.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "kernels/attnres/attnres_train_cuda.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/embed/embedding_cuda.h"
#include "kernels/loss/cross_entropy_cuda.h"
#include "kernels/moe/moe_train_cuda.h"
#include "kernels/norm/norm_train_cuda.h"
#include "model/cuda/training/train_context.h"
#include "model/decoder.h"
#include "model/tensor_table.h"
#include "model/training/model_train.h"

namespace k3 {

struct CudaTrainModel::Impl {
  K3Config c;
  GpuPrecision precision;
  gemm::cuda::GemmContext gemm;
  gpu::DeviceParams params;
  gpu::DeviceArena arena;
  gpu::DeviceArena vision_arena;  // image_text_loss's tower tape: it outlives the text pass's arena reset
  std::vector<std::unique_ptr<moe::cuda::TrainDispatch>> dispatch;  // per MoE layer, reused across steps
  std::vector<int64_t> dispatch_rows;
  std::vector<std::unique_ptr<gpu::ExpertTables>> experts;  // per MoE layer (BF16 mode), built once
  std::vector<bool> experts_built;                          // (null tables: the per-expert path)
  // The packed batch's index arrays (grown as needed).
  cuda::DeviceBuffer<int32_t> cu_seqlens, chunk_offsets, ids, targets, emb_order, emb_run_start, emb_run_id;
  cuda::DeviceBuffer<float> row_weight;  // the step's TokenWeights by row, when given
  cuda::DeviceBuffer<int32_t> all_rows;  // {0, rows}
  cuda::DeviceBuffer<double> loss_sum;
  std::vector<bool> recompute;  // per layer (set_recompute)
  bool batch_invariant = false;  // set_batch_invariant

  Impl(const K3Config& cfg, const train::ParamStore& P, GpuPrecision p)
      : c(cfg),
        precision(p),
        params(P, p),
        dispatch(size_t(cfg.num_hidden_layers)),
        dispatch_rows(size_t(cfg.num_hidden_layers), 0),
        experts(size_t(cfg.num_hidden_layers)),
        experts_built(size_t(cfg.num_hidden_layers), false),
        loss_sum(1) {}
};

namespace gpu {
namespace {

// An input-row span in packed rows: rows [row, row + n) take data.
struct PackedInputRows {
  int64_t row = 0, n = 0;
  const float* data = nullptr;
  float* grad = nullptr;
};

template <class T>
void upload_vector(cuda::DeviceBuffer<T>& buf, const std::vector<T>& v) {
  if (buf.size() < v.size()) buf = cuda::DeviceBuffer<T>(std::max<size_t>(v.size(), 1));
  if (!v.empty()) buf.upload(v.data(), v.size());
}

// One AttnRes + RMSNorm use: the nodes it mixed and what it computed.
struct ResUse {
  std::vector<int> srcs;  // node ids; empty: AttnRes skipped (h is node `direct`)
  int direct = -1;
  TrainParam norm, proj, ln;
  float *h = nullptr, *xn = nullptr, *rstd = nullptr, *alpha = nullptr, *rinv = nullptr, *q = nullptr;
};

struct LayerTape {
  ResUse attn_in, ffn_in;
  KdaTrainTape kda_tape;
  MlaTrainTape mla_tape;
  GluTrainTape dense_tape;
  std::unique_ptr<MoeTrainTape, MoeTapeDeleter> moe_tape;
};

class CudaTrainBackend {
 public:
  using Act = int;
  static constexpr Act kOut = -1;

  CudaTrainBackend(CudaTrainModel::Impl& m, TrainCtx& t, const GpuStepHooks* hooks, double grad_scale,
                   const std::vector<PackedInputRows>& input_rows)
      : m_(m),
        t_(t),
        c_(m.c),
        hooks_(hooks),
        tn_{param_naming(m.params.layout())},
        N_(t.batch.rows),
        D_(m.c.hidden_size),
        tape_(size_t(m.c.num_hidden_layers)),
        grad_scale_(grad_scale),
        input_rows_(input_rows) {
    const std::string head = tn_(TensorKind::LmHead);
    if (m.params.has(head)) lm_head_ = m.params.at(head);
    else if (c_.tie_word_embeddings) lm_head_ = m.params.at(tn_(TensorKind::TokenEmbd));
    else fail("GPU training: ", head, " is missing and the config does not tie embeddings");
  }

  bool profiling() const { return false; }
  void synchronize() {}

  Act embed() {
    float* x = t_.take<float>(N_ * D_);
    embed::cuda::embedding_forward(x, m_.params.at(tn_(TensorKind::TokenEmbd)).w, t_.batch.ids, N_, D_);
    for (const PackedInputRows& r : input_rows_)
      cuda::copy_on_device(x + r.row * D_, r.data, size_t(r.n * D_) * sizeof(float));
    node_.push_back(x);
    return 0;
  }

  void mix(MixSite site, int64_t l, const std::vector<Act>& blocks, Act partial) {
    ResUse& u = use(site, l);
    const MixTensors k = mix_tensors(site);
    const int64_t at = site == MixSite::Output ? -1 : l;
    u.norm = param(k.res_norm, at), u.proj = param(k.res_proj, at), u.ln = param(k.norm, at);
    if (blocks.empty()) {
      u.direct = partial;
      u.h = node_[size_t(partial)];
    } else {
      u.srcs = blocks;
      u.srcs.push_back(partial);
      K3_CHECK(int(u.srcs.size()) <= attnres::cuda::kMaxSources, "GPU training: AttnRes over ", u.srcs.size(),
               " sources; the kernel takes at most ", attnres::cuda::kMaxSources);
      const int S = int(u.srcs.size());
      u.q = t_.take<float>(D_);
      attnres::cuda::attnres_query_forward(u.q, u.norm.w, u.proj.w, D_);
      attnres::cuda::AttnResTrainParams p;
      for (int s = 0; s < S; ++s) p.sources[s] = node_[size_t(u.srcs[size_t(s)])];
      p.S = S, p.N = N_, p.D = D_, p.query = u.q, p.eps = float(c_.rms_norm_eps);
      u.h = p.h = t_.take<float>(N_ * D_);
      u.alpha = p.alpha = t_.take<float>(N_ * S);
      u.rinv = p.rinv = t_.take<float>(N_ * S);
      attnres::cuda::attnres_forward_train(p);
    }
    u.xn = t_.take<float>(N_ * D_), u.rstd = t_.take<float>(N_);
    norm::cuda::rmsnorm_forward_train(u.xn, D_, u.rstd, u.h, D_, u.ln.w, float(c_.rms_norm_eps), N_, D_);
  }

  // With recomputation on for layer l, a block's forward keeps only its output: its tape is handed
  // back to the arena at once and rebuilt by running the forward again in the block's backward (the
  // kernels are deterministic, so the rebuilt tape is the same bits). The AttnRes + norm tapes and
  // the block sums are always kept.
  Act attention(int64_t l) {
    out_ = t_.take<float>(N_ * D_);
    const DeviceArena::Mark m = t_.arena.mark();
    attention_forward(l, out_);
    if (recompute(l)) t_.arena.rewind(m);
    return kOut;
  }

  Act ffn(int64_t l) {
    LayerTape& L = tape_[size_t(l)];
    out_ = t_.take<float>(N_ * D_);
    const DeviceArena::Mark m = t_.arena.mark();
    ffn_forward(l, out_);
    if (c_.is_moe_layer(l) && hooks_ && hooks_->on_router_scores)  // once per step: the recomputation reports nothing
      hooks_->on_router_scores(l, moe_router_scores(*L.moe_tape), N_);
    if (recompute(l)) {
      L.moe_tape.reset();
      t_.arena.rewind(m);
    }
    return kOut;
  }

  void block_output(const char*, int64_t, Act) {}
  Act start_partial(Act) {
    node_.push_back(out_);  // the block output becomes the node (it is never written again)
    return int(node_.size()) - 1;
  }
  void add_partial(Act& partial, Act) {
    float* sum = t_.take<float>(N_ * D_);
    cuda::copy_on_device(sum, node_[size_t(partial)], size_t(N_ * D_) * sizeof(float));
    elementwise::cuda::add_inplace(sum, out_, N_ * D_);
    node_.push_back(sum);
    partial = int(node_.size()) - 1;
  }

  // After head(): each row's log-sum-exp and target logit (device [N]), and a host copy of such a row array.
  const float* lse() const { return lse_; }
  const float* target_logits() const { return tl_; }
  std::vector<float> download_rows(const float* p) const {
    std::vector<float> h(static_cast<size_t>(N_));
    cuda::copy_to_host(h.data(), p, h.size() * sizeof(float));
    return h;
  }

  // The head: lm_head over vocabulary chunks with an online log-sum-exp; the [rows, V] logits are
  // never held. Returns the summed loss, on the device.
  const double* head() {
    const int64_t V = c_.vocab_size;
    // The chunk sets the order of the online log-sum-exp's merges: the batch-invariant mode fixes it.
    chunk_ = t_.batch_invariant ? std::min<int64_t>(V, kInvariantChunk)
                                : std::max<int64_t>(1, std::min<int64_t>(V, kLogitBudget / std::max<int64_t>(N_, 1)));
    lse_ = t_.take<float>(N_), tl_ = t_.take<float>(N_);
    xn16_ = bf16_operand(t_, final_.xn, N_, D_);  // every chunk's operand, forward and backward
    const DeviceArena::Mark m = t_.arena.mark();
    float *mx = t_.take<float>(N_), *sm = t_.take<float>(N_), *tl = tl_;
    float* logits = t_.take<float>(N_ * chunk_);
    loss::cuda::ce_init(mx, sm, tl, N_);
    for (int64_t v0 = 0; v0 < V; v0 += chunk_) {
      const int64_t vc = std::min(chunk_, V - v0);
      train_linear_forward(t_, logits, chunk_, final_.xn, D_, N_, head_rows(v0, vc), false, xn16_);
      loss::cuda::ce_chunk_update(mx, sm, tl, logits, chunk_, t_.batch.targets, N_, v0, vc);
    }
    void* ws = t_.arena.take_bytes(loss::cuda::ce_finish_workspace_bytes(N_));
    loss::cuda::ce_finish(lse_, m_.loss_sum.data(), mx, sm, tl, t_.batch.targets, N_, ws, t_.batch.row_weight);
    t_.arena.rewind(m);
    return m_.loss_sum.data();
  }

  // ---- backward ----
  void head_backward() {
    dnode_.resize(node_.size());
    for (float*& d : dnode_) {
      d = t_.take<float>(N_ * D_);
      cuda::zero_on_device(d, size_t(N_ * D_) * sizeof(float));
    }
    dxn_ = t_.take<float>(N_ * D_), dh_ = t_.take<float>(N_ * D_), dq_ = t_.take<float>(D_);
    const int64_t V = c_.vocab_size;
    const DeviceArena::Mark m = t_.arena.mark();
    float* logits = t_.take<float>(N_ * chunk_);
    for (int64_t v0 = 0; v0 < V; v0 += chunk_) {
      const int64_t vc = std::min(chunk_, V - v0);
      const TrainParam W = head_rows(v0, vc);
      train_linear_forward(t_, logits, chunk_, final_.xn, D_, N_, W, false, xn16_);
      loss::cuda::ce_chunk_grad(logits, chunk_, lse_, t_.batch.targets, float(grad_scale_), N_, v0, vc,
                                t_.batch.row_weight);
      train_linear_backward(t_, dxn_, D_, v0 > 0, logits, chunk_, final_.xn, D_, N_, W, xn16_);
    }
    t_.arena.rewind(m);
  }

  void mix_backward(MixSite site, int64_t l) {
    const ResUse& u = use(site, l);
    const DeviceArena::Mark m = t_.arena.mark();
    void* ws = t_.arena.take_bytes(norm::cuda::rmsnorm_backward_workspace_bytes(N_, D_));
    norm::cuda::rmsnorm_backward_train(dh_, D_, u.ln.g, dxn_, D_, u.h, D_, u.rstd, u.ln.w, N_, D_, ws);
    t_.arena.rewind(m);
    if (u.srcs.empty()) {
      elementwise::cuda::add_inplace(dnode_[size_t(u.direct)], dh_, N_ * D_);
      return;
    }
    const int S = int(u.srcs.size());
    attnres::cuda::AttnResBackwardParams p;
    for (int s = 0; s < S; ++s) {
      p.sources[s] = node_[size_t(u.srcs[size_t(s)])];
      p.dsources[s] = dnode_[size_t(u.srcs[size_t(s)])];
    }
    p.S = S, p.N = N_, p.D = D_, p.query = u.q, p.eps = float(c_.rms_norm_eps);
    p.alpha = u.alpha, p.rinv = u.rinv, p.dh = dh_;
    cuda::zero_on_device(dq_, size_t(D_) * sizeof(float));
    p.dquery = dq_;
    p.workspace = t_.arena.take_bytes(attnres::cuda::attnres_backward_workspace_bytes(N_, D_, S));
    attnres::cuda::attnres_backward_train(p);
    attnres::cuda::attnres_query_backward(u.norm.g, u.proj.g, dq_, u.norm.w, u.proj.w, D_);
    t_.arena.rewind(m);
  }

  void attention_backward(int64_t l, Act d_out) {
    const DeviceArena::Mark m = t_.arena.mark();
    if (recompute(l)) attention_forward(l, t_.take<float>(N_ * D_));
    const LayerTape& L = tape_[size_t(l)];
    if (kda_layer(l)) kda_train_backward(t_, l, L.kda_tape, dnode_[size_t(d_out)], dxn_);
    else mla_train_backward(t_, l, L.mla_tape, dnode_[size_t(d_out)], dxn_);
    t_.arena.rewind(m);
  }
  void ffn_backward(int64_t l, Act d_out) {
    const DeviceArena::Mark m = t_.arena.mark();
    if (recompute(l)) ffn_forward(l, t_.take<float>(N_ * D_));
    LayerTape& L = tape_[size_t(l)];
    if (c_.is_moe_layer(l)) moe_train_backward(t_, l, *L.moe_tape, dnode_[size_t(d_out)], dxn_);
    else dense_train_backward(t_, l, L.dense_tape, dnode_[size_t(d_out)], dxn_);
    if (recompute(l)) L.moe_tape.reset();
    t_.arena.rewind(m);
  }
  void add_gradient(Act dst, Act src) {
    elementwise::cuda::add_inplace(dnode_[size_t(dst)], dnode_[size_t(src)], N_ * D_);
  }
  void embed_backward(Act embedding, const int32_t* order, const int32_t* run_start, const int32_t* run_id,
                      int64_t runs) {
    embed::cuda::embedding_backward(m_.params.at(tn_(TensorKind::TokenEmbd)).g, dnode_[size_t(embedding)], order,
                                    run_start, run_id, runs, D_);
    for (const PackedInputRows& r : input_rows_)
      if (r.grad)
        cuda::copy_on_device(r.grad, dnode_[size_t(embedding)] + r.row * D_, size_t(r.n * D_) * sizeof(float));
  }
  // decoder_backward's form: the runs come from the model (set_embedding_runs).
  void embed_backward(Act embedding) { embed_backward(embedding, runs_order_, runs_start_, runs_id_, runs_); }
  void set_embedding_runs(const int32_t* order, const int32_t* start, const int32_t* id, int64_t runs) {
    runs_order_ = order, runs_start_ = start, runs_id_ = id, runs_ = runs;
  }

 private:
  // Logits held per chunk: rows × chunk fp32 values (256 MiB).
  static constexpr int64_t kLogitBudget = int64_t(64) << 20;
  static constexpr int64_t kInvariantChunk = 4096;  // a multiple of 8 (the fixed-tile GEMM's grid)

  TrainParam param(TensorKind k, int64_t l = -1) const { return m_.params.at(tn_(k, l)); }
  bool recompute(int64_t l) const { return size_t(l) < m_.recompute.size() && m_.recompute[size_t(l)]; }
  void attention_forward(int64_t l, float* out) {
    LayerTape& L = tape_[size_t(l)];
    if (kda_layer(l)) kda_train_forward(t_, l, L.attn_in.xn, out, L.kda_tape);
    else mla_train_forward(t_, l, L.attn_in.xn, out, L.mla_tape);
  }
  void ffn_forward(int64_t l, float* out) {
    LayerTape& L = tape_[size_t(l)];
    if (c_.is_moe_layer(l)) {
      const float* bias = nullptr;
      if (hooks_ && hooks_->router_bias) bias = hooks_->router_bias(l);
      else if (m_.params.has(tn_(TensorKind::MoeRouterBias, l))) bias = param(TensorKind::MoeRouterBias, l).w;
      const int32_t* forced = hooks_ && hooks_->router_replay ? hooks_->router_replay(l) : nullptr;
      L.moe_tape = moe_train_forward(t_, l, L.ffn_in.xn, out, bias, forced, dispatch(l), expert_tables(l));
    } else {
      dense_train_forward(t_, l, L.ffn_in.xn, out, L.dense_tape);
    }
  }
  bool kda_layer(int64_t l) const { return c_.layer_kind[size_t(l)] == AttnKind::KDA; }
  ResUse& use(MixSite site, int64_t l) {
    if (site == MixSite::Output) return final_;
    return site == MixSite::AttnIn ? tape_[size_t(l)].attn_in : tape_[size_t(l)].ffn_in;
  }
  // Rows [v0, v0 + n) of the head matrix as a matrix of its own.
  TrainParam head_rows(int64_t v0, int64_t n) const {
    TrainParam p = lm_head_;
    p.w += v0 * D_, p.g += v0 * D_;
    if (p.w16) p.w16 += v0 * D_;
    p.rows = n, p.numel = n * D_;
    return p;
  }
  moe::cuda::TrainDispatch& dispatch(int64_t l) {
    auto& d = m_.dispatch[size_t(l)];
    if (!d || m_.dispatch_rows[size_t(l)] < N_) {
      d = std::make_unique<moe::cuda::TrainDispatch>(N_, c_.num_experts, c_.num_experts_per_token);
      m_.dispatch_rows[size_t(l)] = N_;
    }
    return *d;
  }

  const ExpertTables* expert_tables(int64_t l) {
    if (m_.precision != GpuPrecision::BF16) return nullptr;
    if (!m_.experts_built[size_t(l)]) {
      m_.experts[size_t(l)] = make_expert_tables(t_, l);
      m_.experts_built[size_t(l)] = true;
    }
    return m_.experts[size_t(l)].get();
  }

  CudaTrainModel::Impl& m_;
  TrainCtx& t_;
  const K3Config& c_;
  const GpuStepHooks* hooks_;
  const TensorNames tn_;
  TrainParam lm_head_;
  const int64_t N_, D_;
  std::vector<LayerTape> tape_;
  ResUse final_;
  std::vector<float*> node_, dnode_;
  float* out_ = nullptr;
  float *lse_ = nullptr, *dxn_ = nullptr, *dh_ = nullptr, *dq_ = nullptr;
  float* tl_ = nullptr;             // [N] each row's target logit (ce_finish's input)
  const uint16_t* xn16_ = nullptr;  // the final norm's output in bf16 (BF16 mode): the lm_head chunks' operand
  int64_t chunk_ = 0;
  const double grad_scale_;
  const std::vector<PackedInputRows>& input_rows_;
  const int32_t *runs_order_ = nullptr, *runs_start_ = nullptr, *runs_id_ = nullptr;
  int64_t runs_ = 0;
};

}  // namespace
}  // namespace gpu

CudaTrainModel::CudaTrainModel() = default;
CudaTrainModel::~CudaTrainModel() = default;

std::unique_ptr<CudaTrainModel> CudaTrainModel::create(const K3Config& c, const train::ParamStore& P,
                                                       GpuPrecision precision) {
  std::string why;
  if (!cuda::available(&why)) fail("GPU training cannot start: ", why);
  if (const std::string p = gpu_train_config_problem(c); !p.empty()) fail(c.source, ": GPU training: ", p);
  std::unique_ptr<CudaTrainModel> m(new CudaTrainModel);
  m->impl_ = std::make_unique<Impl>(c, P, precision);
  return m;
}

const K3Config& CudaTrainModel::config() const { return impl_->c; }
GpuPrecision CudaTrainModel::precision() const { return impl_->precision; }
float* CudaTrainModel::values_device() { return impl_->params.values(); }
float* CudaTrainModel::grads_device() { return impl_->params.grads(); }
int64_t CudaTrainModel::numel() const { return impl_->params.numel(); }
void CudaTrainModel::zero_grads() { impl_->params.zero_grads(); }
void CudaTrainModel::values_changed() { impl_->params.refresh_bf16(); }
void CudaTrainModel::upload(const train::ParamStore& P) { impl_->params.upload(P); }
void CudaTrainModel::download_values(train::ParamStore& P) const { impl_->params.download_values(P); }
void CudaTrainModel::download_grads(train::ParamStore& P) const { impl_->params.download_grads(P); }
gemm::cuda::GemmContext& CudaTrainModel::gemm() { return impl_->gemm; }
void CudaTrainModel::set_batch_invariant(bool on) {
  if (on && impl_->precision != GpuPrecision::BF16)
    fail("batch-invariant GPU training runs on the bf16 fixed-tile GEMMs: it needs the bf16 precision");
  impl_->batch_invariant = on;
}
bool CudaTrainModel::batch_invariant() const { return impl_->batch_invariant; }

void CudaTrainModel::set_recompute(const std::vector<bool>& layers) {
  K3_CHECK(layers.empty() || int64_t(layers.size()) == impl_->c.num_hidden_layers, "set_recompute: ", layers.size(),
           " flags for a model of ", impl_->c.num_hidden_layers, " layers");
  impl_->recompute = layers;
}
size_t CudaTrainModel::parameter_bytes() const { return impl_->params.bytes(); }
int64_t CudaTrainModel::grouped_expert_layers() const {
  int64_t n = 0;
  for (const auto& e : impl_->experts) n += e != nullptr;
  return n;
}

double CudaTrainModel::loss(const std::vector<std::vector<int32_t>>& pieces, bool backward, double grad_scale,
                            const GpuStepHooks* hooks, std::vector<std::vector<double>>* token_losses,
                            const std::vector<GpuInputRows>* input_rows, const std::vector<train::TokenMask>* trained,
                            const std::vector<train::TokenWeights>* weights) {
  Impl& m = *impl_;
  const K3Config& c = m.c;
  K3_CHECK(!token_losses || !input_rows || input_rows->empty(),
           "GPU training: per-token losses are not kept for a step with input rows (positions before them predict "
           "nothing)");
  K3_CHECK(!token_losses || !trained,
           "GPU training: per-token losses are not kept for a step with trained-token masks");
  K3_CHECK(!token_losses || !weights, "GPU training: per-token losses are not kept for a step with token weights");
  train::check_per_token(pieces, trained);
  train::check_per_token(pieces, weights);
  // Input rows: each span checked against its piece and the others; their positions marked.
  std::vector<std::vector<bool>> taken(pieces.size());
  for (size_t p = 0; p < pieces.size(); ++p) taken[p].assign(pieces[p].size(), false);
  if (input_rows)
    for (const GpuInputRows& r : *input_rows) {
      K3_CHECK(r.piece >= 0 && r.piece < int64_t(pieces.size()), "GPU training: input rows of piece ", r.piece,
               " in a step of ", pieces.size());
      const int64_t T = int64_t(pieces[size_t(r.piece)].size());
      K3_CHECK(r.at >= 0 && r.n >= 0 && r.at + r.n <= T && (r.data || r.n == 0), "GPU training: input rows [", r.at,
               ", ", r.at + r.n, ") of piece ", r.piece, " do not fit its ", T, " positions");
      for (int64_t i = r.at; i < r.at + r.n; ++i) {
        K3_CHECK(!taken[size_t(r.piece)][size_t(i)], "GPU training: input rows overlap at position ", i, " of piece ",
                 r.piece);
        taken[size_t(r.piece)][size_t(i)] = true;
      }
    }
  // The packed batch: offsets, KDA chunk offsets, ids and next-token targets, embedding runs.
  // A position whose next position is an input row predicts nothing (target -1).
  std::vector<int32_t> cu{0}, chunks{0}, ids, targets;
  std::vector<float> row_weight;  // row i of a piece predicts its token i + 1
  std::vector<bool> from_rows;
  int64_t max_len = 0;
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    const std::vector<int32_t>& p = pieces[pi];
    if (p.empty()) fail("GPU training: empty sequence");
    for (size_t i = 0; i < p.size(); ++i) {
      if (p[i] < 0 || p[i] >= c.vocab_size) fail("GPU training: token id ", p[i], " outside [0, ", c.vocab_size, ")");
      ids.push_back(p[i]);
      const bool target = i + 1 < p.size() && !taken[pi][i + 1] && (!trained || (*trained)[pi][i + 1]);
      targets.push_back(target ? p[i + 1] : -1);
      if (weights) row_weight.push_back(i + 1 < p.size() ? float((*weights)[pi][i + 1]) : 0.0f);
      from_rows.push_back(taken[pi][i]);
    }
    K3_CHECK(ids.size() < size_t(INT32_MAX), "GPU training: a step of more than 2^31 tokens");
    cu.push_back(int32_t(ids.size()));
    chunks.push_back(chunks.back() + int32_t((p.size() + 15) / 16));
    max_len = std::max<int64_t>(max_len, int64_t(p.size()));
  }
  if (pieces.empty()) return 0.0;
  const embed::cuda::EmbeddingRuns runs = embed::cuda::make_embedding_runs(ids, &from_rows);
  std::vector<gpu::PackedInputRows> packed_rows;
  if (input_rows)
    for (const GpuInputRows& r : *input_rows) packed_rows.push_back({cu[size_t(r.piece)] + r.at, r.n, r.data, r.grad});
  gpu::upload_vector(m.cu_seqlens, cu), gpu::upload_vector(m.chunk_offsets, chunks);
  gpu::upload_vector(m.ids, ids), gpu::upload_vector(m.targets, targets);
  gpu::upload_vector(m.emb_order, runs.order), gpu::upload_vector(m.emb_run_start, runs.run_start);
  gpu::upload_vector(m.emb_run_id, runs.run_id);
  gpu::upload_vector(m.all_rows, std::vector<int32_t>{0, int32_t(ids.size())});

  gpu::PackedBatch batch;
  batch.B = int(pieces.size()), batch.rows = int64_t(ids.size()), batch.max_len = max_len, batch.chunks = chunks.back();
  batch.cu_seqlens = m.cu_seqlens.data(), batch.chunk_offsets = m.chunk_offsets.data();
  batch.ids = m.ids.data(), batch.targets = m.targets.data(), batch.all_rows = m.all_rows.data();
  if (weights) {
    gpu::upload_vector(m.row_weight, row_weight);
    batch.row_weight = m.row_weight.data();
  }

  m.arena.reset();
  gpu::TrainCtx t{c, m.precision, m.gemm, m.arena, m.params, batch};
  t.batch_invariant = m.batch_invariant;
  gpu::CudaTrainBackend be(m, t, hooks, grad_scale, packed_rows);
  be.set_embedding_runs(m.emb_order.data(), m.emb_run_start.data(), m.emb_run_id.data(), int64_t(runs.run_id.size()));
  DecoderTape<gpu::CudaTrainBackend::Act> tape;
  decoder_forward(be, c, nullptr, &tape);
  if (backward) decoder_backward(be, c, tape);
  double loss = 0.0;
  cuda::copy_to_host(&loss, m.loss_sum.data(), sizeof(double));
  if (token_losses) {  // lse − target logit per predicting row, piece by piece
    const std::vector<float> lse = be.download_rows(be.lse()), tl = be.download_rows(be.target_logits());
    token_losses->assign(pieces.size(), {});
    for (size_t p = 0; p < pieces.size(); ++p)
      for (int32_t r = cu[p]; r + 1 < cu[p + 1]; ++r)
        (*token_losses)[p].push_back(double(lse[size_t(r)]) - double(tl[size_t(r)]));
  }
  return loss;
}

double CudaTrainModel::image_text_loss(const std::vector<train::ImageTextSequence>& seqs, const VisionConfig& vc,
                                       bool backward, double grad_scale, const GpuStepHooks* hooks, int64_t* targets) {
  Impl& m = *impl_;
  const K3Config& c = m.c;
  if (m.batch_invariant)
    fail("GPU image-text training: the vision tower's GEMMs have no batch-invariant form; turn the batch-invariant "
         "mode off for steps with images");
  K3_CHECK(vc.text_hidden_size == c.hidden_size, "GPU image-text training: the projector writes ", vc.text_hidden_size,
           " values a token (", vc.source, "), and the text model's hidden_size is ", c.hidden_size);
  const int64_t V = vc.patch_values(), H = c.hidden_size;
  // Every image of the step, sequences in order: pixels (rounded to fp32), grids, and the span its tokens take
  // (checked before the tower runs); the text positions that predict a token, counted per sequence as the CPU does.
  std::vector<float> pixels;
  std::vector<VisionGrid> grids;
  std::vector<GpuInputRows> rows;  // data and grad filled once the tower's outputs exist
  std::vector<std::vector<int32_t>> pieces;
  int64_t tokens = 0, target_total = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const train::ImageTextSequence& s = seqs[i];
    K3_CHECK(s.image_at.size() == s.grids.size(), "GPU image-text training: sequence ", i, " has ", s.image_at.size(),
             " image positions for ", s.grids.size(), " images");
    K3_CHECK(int64_t(s.pixel_patches.size()) % V == 0, "GPU image-text training: sequence ", i, "'s ",
             s.pixel_patches.size(), " pixel values are not whole patches of ", V);
    int64_t patches = 0;
    std::vector<train::TrainInputRows> spans;
    for (size_t g = 0; g < s.grids.size(); ++g) {
      const int64_t n = vc.merged_tokens(s.grids[g].h, s.grids[g].w), at = s.image_at[g];
      K3_CHECK(at >= 0 && at + n <= int64_t(s.ids.size()), "GPU image-text training: sequence ", i, "'s image ", g,
               " of ", n, " tokens from position ", at, " does not fit its ", s.ids.size(), " ids");
      patches += s.grids[g].patches();
      grids.push_back(s.grids[g]);
      rows.push_back({int64_t(i), at, n, nullptr, nullptr});
      spans.push_back({at, n, nullptr, nullptr});
      tokens += n;
    }
    K3_CHECK(patches * V == int64_t(s.pixel_patches.size()), "GPU image-text training: sequence ", i, "'s grids hold ",
             patches, " patches and its pixels ", s.pixel_patches.size() / size_t(V));
    for (double x : s.pixel_patches) pixels.push_back(float(x));
    pieces.push_back(s.ids);
    target_total += train::target_count(int64_t(s.ids.size()), spans);
  }
  const int64_t L = int64_t(pixels.size()) / V;

  m.vision_arena.reset();
  const gpu::PackedBatch no_batch;  // the tower reads none of the text batch
  gpu::TrainCtx t{c, m.precision, m.gemm, m.vision_arena, m.params, no_batch};
  float* pixels_d = t.take<float>(std::max<int64_t>(L * V, 1));
  if (!pixels.empty()) cuda::copy_to_device(pixels_d, pixels.data(), pixels.size() * sizeof(float));
  float* projected = nullptr;
  std::unique_ptr<gpu::VisionTrainTape, gpu::VisionTapeDeleter> tape;
  if (!grids.empty()) tape = gpu::vision_train_forward(t, vc, pixels_d, L, grids, &projected);
  float* dprojected = backward && tokens > 0 ? t.take<float>(tokens * H) : nullptr;
  int64_t first = 0;
  for (GpuInputRows& r : rows) {
    r.data = projected + first * H;
    if (dprojected) r.grad = dprojected + first * H;
    first += r.n;
  }
  const double loss = this->loss(pieces, backward, grad_scale, hooks, nullptr, &rows);
  if (targets) *targets = target_total;
  if (backward && tape) gpu::vision_train_backward(t, vc, *tape, dprojected);
  return loss;
}

}  // namespace k3
#endif  // K3_HAVE_CUDA
