// The K3 text model on the GPU (cuda_model.h): loading, the device cache, and the forward pass: the
// GPU backend of the decoder schedule (model/decoder.h), which model/model.cpp's CPU backend runs too.
#ifdef K3_HAVE_CUDA
#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <utility>

#include "core/error.h"
#include "core/finite.h"
#include "kernels/attnres/attnres_cuda.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/gemm/linear_rows_cuda.h"
#include "kernels/norm/norm_cuda.h"
#include "kernels/sample/pick_cuda.h"
#include "model/cuda/cuda_model_impl.h"
#include "model/decoder.h"
#include "model/nonfinite.h"

namespace k3 {

using gpu::bf16;

// ---- scratch arena and the linear helper -----------------------------------------------------------
namespace gpu {

void DeviceArena::reset() {
  // A stack in one chunk of the high-water size holds every forward seen so far. (Freeing the old
  // chunks synchronises with the device: the previous forward has finished with them.)
  if (chunks_.size() > 1 || (!chunks_.empty() && chunks_[0].size() < peak_)) {
    chunks_.clear();
    chunks_.emplace_back(peak_);
  }
  used_ = 0;
  in_use_ = 0;
}

size_t DeviceArena::reserved_bytes() const {
  size_t n = 0;
  for (const auto& c : chunks_) n += c.size();
  return n;
}

void DeviceArena::rewind(const Mark& m) {
  K3_CHECK(m.in_use <= in_use_ && m.chunks <= chunks_.size(), "DeviceArena::rewind: a mark from the future");
  if (chunks_.size() > m.chunks) {
    // Everything in the chunks added since the mark was taken after it (and nothing in the mark's own
    // chunk when the mark is at its start). Continue at the start of the largest of them and free the
    // others: kept idle until reset, a long step's backward (a new working set per layer) would hold
    // the sum of all of them; keeping the largest lets the next layer's working set fit without a new
    // allocation. (Freeing synchronises with the device, so kernels still reading them have finished;
    // chunks are added only while the high-water mark grows.)
    const size_t live = m.used == 0 && m.chunks > 0 ? m.chunks - 1 : m.chunks;
    if (chunks_.size() > live + 1) {
      size_t big = live;
      for (size_t i = live + 1; i < chunks_.size(); ++i)
        if (chunks_[i].size() > chunks_[big].size()) big = i;
      cuda::DeviceBuffer<uint8_t> keep = std::move(chunks_[big]);
      chunks_.resize(live);
      chunks_.push_back(std::move(keep));
    }
    used_ = 0;
  } else {
    used_ = m.used;
  }
  in_use_ = m.in_use;
}

void* DeviceArena::take_bytes(size_t bytes) {
  constexpr size_t kAlign = 256;
  bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  if (bytes == 0) bytes = kAlign;
  if (chunks_.empty() || used_ + bytes > chunks_.back().size()) {
    // An empty newest chunk that is too small holds nothing: replace it rather than idle beside it.
    if (!chunks_.empty() && used_ == 0) chunks_.pop_back();
    chunks_.emplace_back(std::max(bytes, size_t(64) << 20));
    used_ = 0;
  }
  void* p = chunks_.back().data() + used_;
  used_ += bytes;
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return p;
}

// The head (the vocabulary's rows) stays with cuBLAS in every step: it streams them at the memory's bandwidth.
namespace {
constexpr int64_t kLinearRowsMaxWeightRows = 65536;
}  // namespace

template <class T>
void linear(Run& r, void* y, DType y_type, int64_t ld_y, const T* x, int64_t ld_x, int64_t M, const DevMatrix& W,
            bool accumulate) {
  if constexpr (std::is_same_v<T, float>) {
    K3_CHECK(y_type == DType::F32, "GPU model (F32 path): a linear output must be F32");
    if (!accumulate) {
      gemm::cuda::linear_exact(r.gemm, static_cast<float*>(y), ld_y, x, ld_x, W.as<double>(), M, W.rows, W.cols);
      return;
    }
    // The exact GEMM rounds its fp64 sum once to fp32; the sum is then added (dense y: ld_y = W.rows).
    K3_CHECK(ld_y == W.rows, "GPU model (F32 path): an accumulating linear needs dense rows");
    const DeviceArena::Mark scratch = r.arena.mark();
    float* t = r.arena.take<float>(M * W.rows);
    gemm::cuda::linear_exact(r.gemm, t, W.rows, x, ld_x, W.as<double>(), M, W.rows, W.cols);
    elementwise::cuda::add_inplace(static_cast<float*>(y), t, M * W.rows);
    r.arena.rewind(scratch);
  } else {
    if (takes_linear_rows(r, M) && W.rows <= kLinearRowsMaxWeightRows) {
      gemm::cuda::LinearRowsOutput l;
      l.w = W.as<uint16_t>(), l.N = W.rows, l.y = y, l.y_type = y_type, l.ld_y = ld_y, l.accumulate = accumulate;
      if (gemm::cuda::linear_rows_can_run(x, ld_x, M, W.cols, &l, 1).empty()) {
        gemm::cuda::linear_rows(x, ld_x, M, W.cols, &l, 1);
        return;
      }
    }
    gemm::cuda::LinearParams p;
    p.y = y, p.y_type = y_type, p.ld_y = ld_y, p.x = x, p.ld_x = ld_x, p.w = W.as<bf16>(), p.in_type = DType::BF16;
    p.M = M, p.N = W.rows, p.K = W.cols, p.accumulate = accumulate;
    gemm::cuda::linear_forward(r.gemm, p);
  }
}
template void linear<float>(Run&, void*, DType, int64_t, const float*, int64_t, int64_t, const DevMatrix&, bool);
template void linear<bf16>(Run&, void*, DType, int64_t, const bf16*, int64_t, int64_t, const DevMatrix&, bool);

template <class T>
void linears_of_rows(Run& r, const T* x, int64_t M, std::initializer_list<LinearOut> outs) {
  std::vector<LinearOut> live;
  for (const LinearOut& o : outs)
    if (o.W && o.y) live.push_back(o);
  if (live.empty()) return;
  const int64_t K = live[0].W->cols;
  for (const LinearOut& o : live)
    K3_CHECK(o.W->cols == K, "linears_of_rows: weights of ", o.W->cols, " and ", K, " columns");
  if constexpr (std::is_same_v<T, bf16>) {
    if (takes_linear_rows(r, M) && int(live.size()) <= gemm::cuda::kLinearRowsMaxOutputs) {
      std::vector<gemm::cuda::LinearRowsOutput> ro;
      for (const LinearOut& o : live) {
        gemm::cuda::LinearRowsOutput l;
        l.w = o.W->as<uint16_t>(), l.N = o.W->rows, l.y = o.y, l.y_type = o.y_type;
        ro.push_back(l);
      }
      if (gemm::cuda::linear_rows_can_run(x, K, M, K, ro.data(), int(ro.size())).empty()) {
        gemm::cuda::linear_rows(x, K, M, K, ro.data(), int(ro.size()));
        return;
      }
    }
  }
  for (const LinearOut& o : live) linear<T>(r, o.y, o.y_type, o.W->rows, x, K, M, *o.W);
}
template void linears_of_rows<float>(Run&, const float*, int64_t, std::initializer_list<LinearOut>);
template void linears_of_rows<bf16>(Run&, const bf16*, int64_t, std::initializer_list<LinearOut>);

}  // namespace gpu

// ---- the cache -----------------------------------------------------------------------------------------
CudaSequenceCache::CudaSequenceCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaSequenceCache::~CudaSequenceCache() = default;
int64_t CudaSequenceCache::length() const { return impl_->length; }
struct CudaStateCopy::Impl {
  std::vector<cuda::DeviceBuffer<float>> kda;    // per layer (KDA): q_tail | k_tail | v_tail | state
  std::vector<cuda::DeviceBuffer<uint8_t>> mla;  // per layer (MLA): rows [begin, end), ldc elements each
  int64_t begin = 0, end = 0;
  size_t bytes = 0;
};
CudaStateCopy::CudaStateCopy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaStateCopy::~CudaStateCopy() = default;
size_t CudaStateCopy::bytes() const { return impl_->bytes; }

size_t CudaSequenceCache::bytes() const {  // this sequence's share of its pool
  const gpu::CachePool& p = *impl_->pool;
  size_t b = 0;
  for (auto& k : p.kda) b += (k.q_tail.size() + k.k_tail.size() + k.v_tail.size() + k.state.size()) * 4;
  b /= size_t(p.B);  // (the KDA slices of every place are alike)
  for (auto& m : p.mla)
    if (!m.rows.empty()) b += m.rows[size_t(impl_->index)].size();
  return b;
}

namespace gpu {
std::vector<SeqGroup> seq_groups(const std::vector<SegmentDev>& segs, bool same_length) {
  if (segs.empty()) return {};
  bool one = segs.size() > 1;
  const CudaSequenceCache::Impl& c0 = *segs[0].cache;
  for (size_t i = 1; i < segs.size() && one; ++i) {
    const CudaSequenceCache::Impl& c = *segs[i].cache;
    one = c.pool == c0.pool && c.index == c0.index + int64_t(i) && segs[i].n == segs[0].n &&
          segs[i].row0 == segs[0].row0 + int64_t(i) * segs[0].n && (!same_length || c.length == c0.length);
  }
  if (one) return {SeqGroup{segs[0].row0, segs[0].n, int64_t(segs.size()), segs[0].cache}};
  std::vector<SeqGroup> g;
  for (const SegmentDev& s : segs) g.push_back(SeqGroup{s.row0, s.n, 1, s.cache});
  return g;
}
}  // namespace gpu

// ---- decode graphs ---------------------------------------------------------------------------------------
namespace gpu {
// A pooled decode step (PooledDecode) of one pool captured as a CUDA graph for `bucket` rows: the step's B
// sequences and bucket - B padding rows, which run the pool's padding place (token 0 at its position 4; its state
// is garbage and nothing reads it). The graph has its own arena and MoE dispatch, so what it captured stays put;
// its inputs (ids, places, lengths, where each sequence's MLA rows are, picks) and outputs (ids, checks) sit at
// fixed device addresses. The MLA decode plans its splits for the pool's largest capacity rather than the step's
// lengths; a sequence that outgrows it has the graph made again.
struct DecodeGraph {
  std::weak_ptr<CachePool> pool;  // (a graph of a freed pool is dropped: it holds that pool's addresses)
  int64_t bucket = 0;
  int64_t plan_cap = 0;  // the MLA decode's splits cover sequences of up to this many rows
  DeviceArena arena;
  std::unique_ptr<moe::cuda::Dispatch> dispatch;
  cuda::DeviceBuffer<int32_t> in;     // ids | places | lengths, bucket each
  cuda::DeviceBuffer<uint8_t> table;  // each row's MLA rows, [MLA layers][bucket] pointers
  cuda::DeviceBuffer<uint8_t> pick;   // sample::cuda::PickRow [bucket]
  cuda::DeviceBuffer<int32_t> out;    // ids | bad, bucket each
  float* logits = nullptr;            // [bucket, V] in the arena
  std::unique_ptr<cuda::Graph> graph;
};

// Rows of the graph for a step of B sequences: powers of two to 32, then multiples of 32.
int64_t graph_bucket(int64_t B) {
  if (B <= 32) {
    int64_t b = 1;
    while (b < B) b *= 2;
    return b;
  }
  return (B + 31) / 32 * 32;
}
}  // namespace gpu

// ---- the model -----------------------------------------------------------------------------------------
struct CudaModel::Impl {
  uint64_t id = next_id();  // caches remember it (a pointer could be reused by a later model)
  static uint64_t next_id() {
    static std::atomic<uint64_t> n{1};
    return n++;
  }
  K3Config cfg;
  GpuPrecision precision = GpuPrecision::BF16;
  gpu::WeightsDev w;
  int64_t mla_ldc = 0;  // device cache row stride: R + Dr, rounded up to 8 (16-byte rows) in bf16
  std::unique_ptr<gemm::cuda::GemmContext> gemm;
  gpu::DeviceArena arena;
  std::unique_ptr<moe::cuda::Dispatch> dispatch;
  int64_t dispatch_tokens = 0;
  std::string weights_path;  // re-read only to explain non-finite logits (model/nonfinite.h)
  bool profile = false;
  bool reference = PathOptions::from_env().reference;  // K3_REFERENCE=1, as the CPU model
  BlockTimings timings;
  bool use_graphs = true;      // CudaModel::set_graphs
  std::string graphs_off_why;  // set when a capture failed: decode runs eagerly from then on
  std::vector<std::unique_ptr<gpu::DecodeGraph>> graphs;

  // The forward without the check of the logits: fp32 logits [M, V] on the device (the arena's, valid until the
  // next forward), M = all tokens (all_positions) or the sequences.
  float* forward_dev(const std::vector<CudaSequenceCache*>& caches, const std::vector<std::vector<int32_t>>& tokens,
                     bool all_positions, const ForwardHooks* hooks);
  template <class T>
  float* forward_dev(const std::vector<CudaSequenceCache*>& caches, const std::vector<std::vector<int32_t>>& tokens,
                     bool all_positions, const ForwardHooks* hooks);
  void validate(const std::vector<CudaSequenceCache*>& caches, const std::vector<std::vector<int32_t>>& tokens) const;
  template <class T>
  float* run_layers(const std::vector<CudaSequenceCache*>& caches, const std::vector<std::vector<int32_t>>& tokens,
                    bool all_positions, const ForwardHooks* hooks);
  // The MLA row buffers of a pooled decode ([MLA layers][B], the first P of segs, then bucket - P padding rows on
  // the pool's padding place), room made for each sequence's new row (at least `plan` rows when plan > 0).
  std::vector<uint16_t*> pooled_rows(gpu::CachePool& pool, const std::vector<gpu::SegmentDev>& segs, int64_t P,
                                     int64_t bucket) const;
  // The layers and the head over ids already on the device, with the given scratch: what run_layers and a decode
  // graph share.
  template <class T>
  float* run_step(const std::vector<gpu::SegmentDev>& segs, const int32_t* ids_dev, int64_t N, gpu::DeviceArena& ar,
                  moe::cuda::Dispatch* disp, const gpu::PooledDecode* pooled, bool all_positions,
                  const ForwardHooks* hooks);
  // forward_pick's decode step as a CUDA graph, when every sequence is a pooled decode; false (nothing run)
  // when the step is not one, graphs are off or a capture failed.
  bool pick_by_graph(CudaModel& m, const std::vector<CudaSequenceCache*>& caches,
                     const std::vector<std::vector<int32_t>>& tokens, const std::vector<TokenPick>& picks,
                     const std::vector<sample::cuda::PickRow>& rows, std::vector<PickResult>& res);
  // forward_pick's results from the device's picks (ids, bad: [B] on the host) and logits [B, V] on the device:
  // a bad row fails the forward as fail_nonfinite_forward does; rows asked for their logits get them.
  std::vector<PickResult> pick_results(CudaModel& m, const std::vector<CudaSequenceCache*>& caches,
                                       const std::vector<std::vector<int32_t>>& tokens,
                                       const std::vector<TokenPick>& picks, const float* logits_dev, const int32_t* ids,
                                       const int32_t* bad, bool fresh);
  // After a forward whose logits (host copy, `bad` the first non-finite entry) are not all finite: marks the caches
  // broken and throws the error naming where the first non-finite value appeared.
  [[noreturn]] void fail_nonfinite_forward(CudaModel& m, const std::vector<CudaSequenceCache*>& caches,
                                           const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                           const ForwardHooks* hooks, bool fresh, const std::vector<float>& logits,
                                           int64_t bad);
};

CudaModel::CudaModel() : impl_(std::make_unique<Impl>()) {}
CudaModel::~CudaModel() = default;
const K3Config& CudaModel::config() const { return impl_->cfg; }

// A sequence's slices of its pool: each KDA layer's tails and state, each MLA layer's rows.
namespace {
struct StateLayout {
  size_t tail, state, row_bytes;
};
StateLayout state_layout(const K3Config& c, int64_t ldc, GpuPrecision p) {
  return StateLayout{size_t(c.short_conv_kernel_size - 1) * size_t(c.kda_dim()),
                     size_t(c.kda_num_heads) * size_t(c.kda_head_dim) * size_t(c.kda_head_dim),
                     size_t(ldc) * (p == GpuPrecision::BF16 ? 2 : 4)};
}
}  // namespace

size_t CudaModel::sequence_bytes(int64_t tokens) const {
  const K3Config& c = impl_->cfg;
  const StateLayout L = state_layout(c, impl_->mla_ldc, impl_->precision);
  size_t b = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    b += c.layer_kind[size_t(l)] == AttnKind::KDA ? (3 * L.tail + L.state) * 4 : size_t(tokens) * L.row_bytes;
  return b;
}

std::unique_ptr<CudaStateCopy> CudaModel::copy_state(const CudaSequenceCache& cache, int64_t rows_from) const {
  const CudaSequenceCache::Impl& c = const_cast<CudaSequenceCache&>(cache).impl();
  K3_CHECK(c.owner == impl_->id, "copy_state: a cache of another model");
  K3_CHECK(!c.broken, "copy_state: the cache's state is undefined (a forward over it failed)");
  K3_CHECK(rows_from >= 0 && rows_from <= c.length, "copy_state: rows_from ", rows_from, " outside [0, ", c.length,
           "]");
  const K3Config& cfg = impl_->cfg;
  const StateLayout L = state_layout(cfg, impl_->mla_ldc, impl_->precision);
  const gpu::CachePool& p = *c.pool;
  auto out = std::make_unique<CudaStateCopy::Impl>();
  out->begin = rows_from;
  out->end = c.length;
  out->kda.resize(size_t(cfg.num_hidden_layers));
  out->mla.resize(size_t(cfg.num_hidden_layers));
  for (size_t l = 0; l < size_t(cfg.num_hidden_layers); ++l) {
    if (cfg.layer_kind[l] == AttnKind::KDA) {
      const gpu::KdaPoolDev& k = p.kda[l];
      cuda::DeviceBuffer<float> b(3 * L.tail + L.state);
      const size_t t0 = size_t(c.index) * L.tail;
      cuda::copy_on_device(b.data(), k.q_tail.data() + t0, L.tail * 4);
      cuda::copy_on_device(b.data() + L.tail, k.k_tail.data() + t0, L.tail * 4);
      cuda::copy_on_device(b.data() + 2 * L.tail, k.v_tail.data() + t0, L.tail * 4);
      cuda::copy_on_device(b.data() + 3 * L.tail, k.state.data() + size_t(c.index) * L.state, L.state * 4);
      out->bytes += b.size() * 4;
      out->kda[l] = std::move(b);
    } else if (c.length > rows_from) {
      const gpu::MlaPoolDev& m = p.mla[l];
      const size_t n = size_t(c.length - rows_from) * L.row_bytes;
      cuda::DeviceBuffer<uint8_t> b(n);
      cuda::copy_on_device(b.data(), m.rows[size_t(c.index)].data() + size_t(rows_from) * L.row_bytes, n);
      out->bytes += n;
      out->mla[l] = std::move(b);
    }
  }
  return std::make_unique<CudaStateCopy>(std::move(out));
}

void CudaModel::restore_state(CudaSequenceCache& cache, const std::vector<const CudaStateCopy*>& chain) const {
  CudaSequenceCache::Impl& c = cache.impl();
  K3_CHECK(c.owner == impl_->id, "restore_state: a cache of another model");
  K3_CHECK(c.length == 0 && !c.broken, "restore_state: the cache must be fresh");
  K3_CHECK(!chain.empty(), "restore_state: no copies");
  const K3Config& cfg = impl_->cfg;
  const StateLayout L = state_layout(cfg, impl_->mla_ldc, impl_->precision);
  gpu::CachePool& p = *c.pool;
  for (size_t i = 0; i < chain.size(); ++i)
    K3_CHECK(chain[i]->impl_->begin == (i == 0 ? 0 : chain[i - 1]->impl_->end), "restore_state: copy ", i,
             " does not continue the chain");
  const CudaStateCopy::Impl& last = *chain.back()->impl_;
  const int64_t rows = last.end;
  for (size_t l = 0; l < size_t(cfg.num_hidden_layers); ++l) {
    if (cfg.layer_kind[l] == AttnKind::KDA) {
      gpu::KdaPoolDev& k = p.kda[l];
      const float* b = last.kda[l].data();
      const size_t t0 = size_t(c.index) * L.tail;
      cuda::copy_on_device(k.q_tail.data() + t0, b, L.tail * 4);
      cuda::copy_on_device(k.k_tail.data() + t0, b + L.tail, L.tail * 4);
      cuda::copy_on_device(k.v_tail.data() + t0, b + 2 * L.tail, L.tail * 4);
      cuda::copy_on_device(k.state.data() + size_t(c.index) * L.state, b + 3 * L.tail, L.state * 4);
    } else if (rows > 0) {
      gpu::MlaPoolDev& m = p.mla[l];
      gpu::reserve_rows(m, c.index, rows, impl_->mla_ldc, L.row_bytes / size_t(impl_->mla_ldc));
      size_t at = 0;
      for (const CudaStateCopy* s : chain) {
        const cuda::DeviceBuffer<uint8_t>& r = s->impl_->mla[l];
        if (r.size() == 0) continue;
        cuda::copy_on_device(m.rows[size_t(c.index)].data() + at, r.data(), r.size());
        at += r.size();
      }
    }
  }
  c.length = rows;
}

GpuPrecision CudaModel::precision() const { return impl_->precision; }
size_t CudaModel::weight_bytes() const { return impl_->w.bytes; }
void CudaModel::set_profile(bool on) { impl_->profile = on; }
void CudaModel::set_graphs(bool on) { impl_->use_graphs = on; }
std::string CudaModel::graphs_off_reason() const { return impl_->graphs_off_why; }
int64_t CudaModel::graph_count() const { return int64_t(impl_->graphs.size()); }
void CudaModel::set_reference(bool on) { impl_->reference = on; }
bool CudaModel::reference() const { return impl_->reference; }
const BlockTimings& CudaModel::timings() const { return impl_->timings; }
void CudaModel::reset_timings() { impl_->timings = BlockTimings{}; }

std::unique_ptr<CudaModel> CudaModel::load(const std::string& dir, GpuPrecision precision) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(dir, ": not a model directory (expected config.json and safetensors inside)");
  return load((fs::path(dir) / "config.json").string(), dir, precision);
}

std::unique_ptr<CudaModel> CudaModel::load(const std::string& config_path, const std::string& weights_path,
                                           GpuPrecision precision) {
  std::string why;
  if (!cuda::available(&why)) fail("the GPU model cannot start: ", why);
  auto m = std::unique_ptr<CudaModel>(new CudaModel());
  Impl& I = *m->impl_;
  I.cfg = load_config(config_path);
  I.precision = precision;
  I.weights_path = weights_path;
  const std::string problem = gpu_config_problem(I.cfg, precision);
  if (!problem.empty())
    fail(I.cfg.source, ": the GPU kernels (", gpu_precision_name(precision), ") cannot run this model: ", problem);
  {
    SafeTensors st = SafeTensors::open(weights_path);  // host mapping only for the upload
    const ModelWeights w = bind_weights(I.cfg, st);
    I.w = gpu::upload_weights(I.cfg, w, precision);
  }
  const int64_t lrow = I.cfg.kv_lora_rank + I.cfg.qk_rope_head_dim;
  I.mla_ldc = precision == GpuPrecision::BF16 ? (lrow + 7) / 8 * 8 : lrow;
  I.gemm = std::make_unique<gemm::cuda::GemmContext>();
  cuda::synchronize();  // the upload ran on this thread's stream; another thread may run the model next
  return m;
}

std::unique_ptr<CudaSequenceCache> CudaModel::new_cache() const { return std::move(new_caches(1)[0]); }

std::vector<std::unique_ptr<CudaSequenceCache>> CudaModel::new_caches(int64_t B) const {
  K3_CHECK(B >= 1, "new_caches: need at least one sequence, got ", B);
  const K3Config& c = impl_->cfg;
  auto pool = std::make_shared<gpu::CachePool>();
  pool->B = B + 1;  // the last place pads decode graphs (gpu::DecodeGraph)
  pool->pad = B;
  const size_t L = size_t(c.num_hidden_layers);
  pool->kda.resize(L);
  pool->mla.resize(L);
  const size_t HD = size_t(c.kda_dim()), tail = size_t(c.short_conv_kernel_size - 1) * HD;
  for (size_t l = 0; l < L; ++l) {
    if (c.layer_kind[l] != AttnKind::KDA) {  // MLA rows are allocated as tokens arrive, per place
      pool->mla[l].rows.resize(size_t(pool->B));
      pool->mla[l].capacity.assign(size_t(pool->B), 0);
      continue;
    }
    const size_t places = size_t(pool->B);
    pool->kda[l].q_tail = gpu::DevVector(tail * places);  // zero-initialised
    pool->kda[l].k_tail = gpu::DevVector(tail * places);
    pool->kda[l].v_tail = gpu::DevVector(tail * places);
    pool->kda[l].state = gpu::DevVector(places * size_t(c.kda_num_heads * c.kda_head_dim * c.kda_head_dim));
  }
  std::vector<std::unique_ptr<CudaSequenceCache>> out;
  for (int64_t b = 0; b < B; ++b) {
    auto s = std::make_unique<CudaSequenceCache::Impl>();
    s->owner = impl_->id;
    s->pool = pool;
    s->index = b;
    out.push_back(std::unique_ptr<CudaSequenceCache>(new CudaSequenceCache(std::move(s))));
  }
  return out;
}

namespace {
bool all_fresh(const std::vector<CudaSequenceCache*>& caches) {
  for (CudaSequenceCache* c : caches)
    if (!c || c->length() != 0) return false;
  return true;
}
}  // namespace

std::vector<float> CudaModel::forward(const std::vector<CudaSequenceCache*>& caches,
                                      const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                      const ForwardHooks* hooks) {
  const bool fresh = all_fresh(caches);
  const float* dev = impl_->forward_dev(caches, tokens, all_positions, hooks);
  int64_t rows = int64_t(tokens.size());
  if (all_positions) {
    rows = 0;
    for (const auto& t : tokens) rows += int64_t(t.size());
  }
  std::vector<float> logits(size_t(rows * impl_->cfg.vocab_size));
  cuda::copy_to_host(logits.data(), dev, logits.size() * 4);
  // Only the logits are checked on the GPU (they come to the host anyway); the block where a
  // non-finite value first appeared is found afterwards, on the failure path only.
  const int64_t bad = first_nonfinite(logits.data(), int64_t(logits.size()));
  if (bad < 0) return logits;
  impl_->fail_nonfinite_forward(*this, caches, tokens, all_positions, hooks, fresh, logits, bad);
}

std::vector<PickResult> CudaModel::forward_pick(const std::vector<CudaSequenceCache*>& caches,
                                                const std::vector<std::vector<int32_t>>& tokens,
                                                const std::vector<TokenPick>& picks, const ForwardHooks* hooks) {
  K3_CHECK(picks.size() == caches.size(), "forward_pick (cuda): ", picks.size(), " picks for ", caches.size(),
           " sequences");
  const int64_t B = int64_t(caches.size()), V = impl_->cfg.vocab_size;
  std::vector<sample::cuda::PickRow> rows(static_cast<size_t>(B));
  for (size_t b = 0; b < picks.size(); ++b) {
    const TokenPick& p = picks[b];
    if (!p.pick) continue;
    if (!p.greedy) {
      K3_CHECK(std::isfinite(p.temperature) && p.temperature > 0.0f, "forward_pick: sequence ", b,
               ": temperature must be > 0, got ", p.temperature);
      K3_CHECK(p.uniform >= 0.0 && p.uniform < 1.0, "forward_pick: sequence ", b, ": the draw must be in [0, 1), got ",
               p.uniform);
    }
    rows[b] = sample::cuda::PickRow{p.greedy ? 1 : 2, p.temperature, p.uniform};
  }
  std::vector<PickResult> res;
  bool logprobs = false;  // the decode graphs keep no log-probabilities: such steps run outside them
  for (const TokenPick& p : picks) logprobs = logprobs || (p.pick && !p.greedy && p.want_logprob);
  if (!hooks && !logprobs && impl_->pick_by_graph(*this, caches, tokens, picks, rows, res)) return res;
  const bool fresh = all_fresh(caches);
  const float* dev = impl_->forward_dev(caches, tokens, false, hooks);
  gpu::DeviceArena& arena = impl_->arena;
  auto* rows_dev = static_cast<sample::cuda::PickRow*>(arena.take_bytes(rows.size() * sizeof(rows[0])));
  cuda::copy_to_device(rows_dev, rows.data(), rows.size() * sizeof(rows[0]));
  int32_t* out_dev = arena.take<int32_t>(2 * B);  // ids [B], bad [B]
  double* logp_dev = logprobs ? arena.take<double>(B) : nullptr;
  sample::cuda::pick_tokens(dev, B, V, rows_dev, out_dev, out_dev + B, logp_dev);
  std::vector<int32_t> out(size_t(2 * B));
  cuda::copy_to_host(out.data(), out_dev, out.size() * 4);
  res = impl_->pick_results(*this, caches, tokens, picks, dev, out.data(), out.data() + B, fresh);
  if (logprobs) {
    std::vector<double> lp(static_cast<size_t>(B));
    cuda::copy_to_host(lp.data(), logp_dev, lp.size() * sizeof(double));
    for (size_t b = 0; b < res.size(); ++b)
      if (picks[b].want_logprob) res[b].logprob = lp[b];
  }
  return res;
}

std::vector<PickResult> CudaModel::Impl::pick_results(CudaModel& m, const std::vector<CudaSequenceCache*>& caches,
                                                      const std::vector<std::vector<int32_t>>& tokens,
                                                      const std::vector<TokenPick>& picks, const float* logits_dev,
                                                      const int32_t* ids, const int32_t* bad, bool fresh) {
  const int64_t B = int64_t(caches.size()), V = cfg.vocab_size;
  for (int64_t b = 0; b < B; ++b) {
    if (bad[b] == 0) continue;
    std::vector<float> logits(size_t(B * V));
    cuda::copy_to_host(logits.data(), logits_dev, logits.size() * 4);
    int64_t at = first_nonfinite(logits.data(), int64_t(logits.size()));
    if (at < 0) at = b * V;  // a row of only -inf
    fail_nonfinite_forward(m, caches, tokens, false, nullptr, fresh, logits, at);
  }
  std::vector<PickResult> res(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    if (picks[size_t(b)].pick) res[size_t(b)].id = ids[b];
    if (picks[size_t(b)].want_logits) {
      res[size_t(b)].logits.resize(size_t(V));
      cuda::copy_to_host(res[size_t(b)].logits.data(), logits_dev + b * V, size_t(V) * 4);
    }
  }
  return res;
}

void CudaModel::reset_cache(CudaSequenceCache& cache) const {
  CudaSequenceCache::Impl& c = cache.impl();
  K3_CHECK(c.owner == impl_->id, "reset_cache: a cache of another model");
  const K3Config& cfg = impl_->cfg;
  const StateLayout L = state_layout(cfg, impl_->mla_ldc, impl_->precision);
  gpu::CachePool& p = *c.pool;
  for (size_t l = 0; l < size_t(cfg.num_hidden_layers); ++l) {
    if (cfg.layer_kind[l] != AttnKind::KDA) continue;  // MLA rows past the length are never read
    gpu::KdaPoolDev& k = p.kda[l];
    const size_t t0 = size_t(c.index) * L.tail;
    cuda::zero_on_device(k.q_tail.data() + t0, L.tail * 4);
    cuda::zero_on_device(k.k_tail.data() + t0, L.tail * 4);
    cuda::zero_on_device(k.v_tail.data() + t0, L.tail * 4);
    cuda::zero_on_device(k.state.data() + size_t(c.index) * L.state, L.state * 4);
  }
  c.length = 0;
  c.broken = false;
}

void CudaModel::Impl::fail_nonfinite_forward(CudaModel& m, const std::vector<CudaSequenceCache*>& caches,
                                             const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                             const ForwardHooks* hooks, bool fresh, const std::vector<float>& logits,
                                             int64_t bad) {
  for (CudaSequenceCache* c : caches) c->impl().broken = true;
  const K3Config& c = cfg;
  const SafeTensors st = SafeTensors::open(weights_path);
  if (fresh && !hooks) {
    // The same forward again on new caches, with every block output copied to the host and checked.
    struct First {
      std::string block;
      int64_t layer = -2, row = 0;
      float value = 0;
    } first;
    ForwardHooks locate;
    locate.tensor = [&](const char* name, int64_t l, const float* d, int64_t rows, int64_t cols) {
      if (first.layer != -2) return;
      if (const int64_t i = first_nonfinite(d, rows * cols); i >= 0) first = {name, l, i / cols, d[i]};
    };
    try {  // forward_dev does not check the logits, so this pass reads no weight
      std::vector<std::unique_ptr<CudaSequenceCache>> again = m.new_caches(int64_t(caches.size()));
      std::vector<CudaSequenceCache*> ptrs;
      for (auto& a : again) ptrs.push_back(a.get());
      forward_dev(ptrs, tokens, all_positions, &locate);
    } catch (const Error&) {  // the pass is for the message; without it, the logits' message below
    }
    if (first.layer != -2) fail_nonfinite(c, st, first.block.c_str(), first.layer, first.row, first.value);
  }
  fail_nonfinite_logits(c, st, bad / c.vocab_size, logits[size_t(bad)],
                        " of the GPU forward (" + std::string(gpu_precision_name(precision)) + ")");
}

float* CudaModel::Impl::forward_dev(const std::vector<CudaSequenceCache*>& caches,
                                    const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                    const ForwardHooks* hooks) {
  return precision == GpuPrecision::F32 ? forward_dev<float>(caches, tokens, all_positions, hooks)
                                        : forward_dev<bf16>(caches, tokens, all_positions, hooks);
}

// Validation errors leave the caches untouched; a failure once the layers have started (out of device
// memory, a kernel error) leaves earlier layers' KDA state and conv tails advanced, so the caches are
// marked broken and refused from then on rather than silently giving wrong logits.
template <class T>
float* CudaModel::Impl::forward_dev(const std::vector<CudaSequenceCache*>& caches,
                                    const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                    const ForwardHooks* hooks) {
  validate(caches, tokens);
  try {
    return run_layers<T>(caches, tokens, all_positions, hooks);
  } catch (...) {
    for (CudaSequenceCache* c : caches) c->impl().broken = true;
    throw;
  }
}

void CudaModel::Impl::validate(const std::vector<CudaSequenceCache*>& caches,
                               const std::vector<std::vector<int32_t>>& tokens) const {
  const K3Config& c = cfg;
  K3_CHECK(caches.size() == tokens.size(), "forward (cuda): ", caches.size(), " caches for ", tokens.size(),
           " sequences");
  K3_CHECK(!tokens.empty(), "forward (cuda): no sequences");
  for (size_t b = 0; b < tokens.size(); ++b) {
    K3_CHECK(caches[b] != nullptr, "forward (cuda): cache ", b, " is null");
    const CudaSequenceCache::Impl& ci = caches[b]->impl();
    K3_CHECK(ci.owner == id, "forward (cuda): cache ", b, " was made by another model");
    K3_CHECK(!ci.broken, "forward (cuda): cache ", b,
             " is in an undefined state after a failed forward; make a new one");
    check_new_tokens(c, b, tokens[b], ci.length);
    for (size_t j = 0; j < b; ++j)
      K3_CHECK(caches[j] != caches[b], "forward (cuda): sequences ", j, " and ", b, " share one cache");
  }
}

namespace gpu {

// The GPU backend of the decoder schedule (model/decoder.h), activation type T (bf16 or float).
// The residual stream (partial sums, completed blocks, block outputs) is fp32; the block inputs x̂
// are T. Each block's scratch is taken from the arena and handed back as soon as its launches are
// queued (one stream: later launches that reuse the memory run after them).
template <class T>
class CudaBackend {
 public:
  using Act = float*;

  CudaBackend(Run& run, const WeightsDev& w, const std::vector<SegmentDev>& segs, const int32_t* ids_dev, int64_t N,
              bool all_positions, bool profile)
      : r_(run),
        c_(run.c),
        w_(w),
        segs_(segs),
        ids_(ids_dev),
        N_(N),
        D_(run.c.hidden_size),
        all_positions_(all_positions),
        profile_(profile) {
    xn_ = r_.arena.take<T>(N_ * D_);
    out_ = r_.arena.take<float>(N_ * D_);
  }

  bool profiling() const { return profile_; }
  void synchronize() { cuda::synchronize(); }

  Act embed() {
    float* e = r_.arena.take<float>(N_ * D_);
    if constexpr (std::is_same_v<T, float>)
      elementwise::cuda::embedding_gather_f32(e, reinterpret_cast<const float*>(w_.embed.data()), ids_, N_,
                                              c_.vocab_size, D_);
    else gemm::cuda::embedding_gather(e, reinterpret_cast<const bf16*>(w_.embed.data()), ids_, N_, c_.vocab_size, D_);
    if (r_.hooks)  // (prompt steps with images: a copy per row is plenty)
      for (const auto& [row, x] : input_rows_of(*r_.hooks, segs_, D_))
        cuda::copy_to_device(e + row * D_, x, size_t(D_) * sizeof(float));
    return e;
  }

  // x̂ <- RMSNorm(AttnRes(blocks, partial; query)) in one kernel; before the first block, RMSNorm alone.
  // A pending update of `partial` (start_partial / add_partial) is done here, fused into the AttnRes kernel.
  void mix(MixSite site, int64_t l, const std::vector<Act>& blocks, Act partial) {
    const LayerDev* L = l >= 0 ? &w_.layers[size_t(l)] : nullptr;
    const DevVector& norm_w = site == MixSite::AttnIn  ? L->input_layernorm
                              : site == MixSite::FfnIn ? L->post_attention_layernorm
                                                       : w_.norm;
    const Pending pending = std::exchange(pending_, Pending{});
    K3_CHECK(!pending.partial || pending.partial == partial, "forward (cuda): a pending update of another partial sum");
    if (blocks.empty()) {
      finish(pending);
      norm::cuda::rmsnorm_forward(xn_, partial, norm_w.data(), float(c_.rms_norm_eps), N_, D_);
      return;
    }
    const DevVector& query = site == MixSite::AttnIn  ? L->attn_res_query
                             : site == MixSite::FfnIn ? L->mlp_res_query
                                                      : w_.output_res_query;
    attnres::cuda::AttnResParams p;
    K3_CHECK(int(blocks.size()) + 1 <= attnres::cuda::kMaxSources, "forward (cuda): ", blocks.size() + 1,
             " AttnRes sources, more than the kernel's ", attnres::cuda::kMaxSources);
    for (size_t i = 0; i < blocks.size(); ++i) p.sources[i] = blocks[i];
    p.sources[blocks.size()] = pending.copy_of ? pending.copy_of : partial;
    p.S = int(blocks.size()) + 1;
    p.last_store = pending.partial, p.last_addend = pending.addend;
    p.src_type = DType::F32, p.N = N_, p.D = D_, p.query = query.data(), p.eps = float(c_.rms_norm_eps);
    p.out_type = dtype_of<T>(), p.normed = xn_, p.norm_weight = norm_w.data(), p.norm_eps = float(c_.rms_norm_eps);
    attnres::cuda::attnres_forward(p);
  }

  Act attention(int64_t l) {
    K3_CHECK(!pending_.partial, "forward (cuda): attention would overwrite a pending update's block output");
    const DeviceArena::Mark scratch = r_.arena.mark();
    const LayerDev& L = w_.layers[size_t(l)];
    if (c_.layer_kind[size_t(l)] == AttnKind::KDA) kda_attention_forward<T>(r_, out_, xn_, N_, segs_, l, L.kda);
    else mla_attention_forward<T>(r_, out_, xn_, N_, segs_, l, L.mla);
    r_.arena.rewind(scratch);
    return out_;
  }

  Act ffn(int64_t l) {
    K3_CHECK(!pending_.partial, "forward (cuda): the FFN would overwrite a pending update's block output");
    const DeviceArena::Mark scratch = r_.arena.mark();
    const LayerDev& L = w_.layers[size_t(l)];
    if (c_.is_moe_layer(l)) moe_ffn_forward<T>(r_, out_, xn_, N_, l, L.moe);
    else dense_ffn_forward<T>(r_, out_, xn_, N_, L.dense);
    r_.arena.rewind(scratch);
    return out_;
  }

  // A block output to the hooks (a host copy); `replace` may hand back what the forward continues from.
  void block_output(const char* name, int64_t l, Act out) {
    const ForwardHooks* hooks = r_.hooks;
    if (!hooks || (!hooks->tensor && !hooks->replace)) return;
    std::vector<float> h(size_t(N_ * D_));
    cuda::copy_to_host(h.data(), out, h.size() * 4);
    if (hooks->tensor) hooks->tensor(name, l, h.data(), N_, D_);
    if (hooks->replace && hooks->replace(name, l, h.data(), N_, D_)) cuda::copy_to_device(out, h.data(), h.size() * 4);
  }

  // The partial sum's updates wait for the next mix, which reads the partial sum first and does them in its own
  // launch (the decoder mixes after every update, before the block output's buffer is written again).
  Act start_partial(Act out) {
    float* p = r_.arena.take<float>(N_ * D_);
    finish(std::exchange(pending_, Pending{p, nullptr, out}));
    return p;
  }
  void add_partial(Act& partial, Act out) { finish(std::exchange(pending_, Pending{partial, out, nullptr})); }

  // An update of the partial sum not yet done: partial += addend, or partial = copy_of.
  struct Pending {
    float* partial = nullptr;
    const float* addend = nullptr;
    const float* copy_of = nullptr;
  };
  void finish(const Pending& p) {  // the update as its own launch
    if (p.addend) elementwise::cuda::add_inplace(p.partial, p.addend, N_ * D_);
    else if (p.copy_of) cuda::copy_on_device(p.partial, p.copy_of, size_t(N_ * D_) * 4);
  }

  // The selected rows of the final x̂ (AttnRes and norm fused in mix), lm_head: fp32 logits [M, V] on the device
  // (in the arena, valid until the next forward).
  float* head() {
    const T* hn = xn_;
    int64_t M = N_;
    if (!all_positions_) {
      M = int64_t(segs_.size());
      T* sel = xn_;  // one row per sequence: x̂ is the selection
      if (M != N_) {
        constexpr DType act = dtype_of<T>();
        sel = r_.arena.take<T>(M * D_);
        for (size_t i = 0; i < segs_.size(); ++i)
          elementwise::cuda::copy_rows(sel + int64_t(i) * D_, act, D_, xn_ + (segs_[i].row0 + segs_[i].n - 1) * D_, act,
                                       D_, 1, D_);
      }
      hn = sel;
    }
    float* logits_dev = r_.arena.take<float>(M * c_.vocab_size);
    linear_f32_out<T>(r_, logits_dev, hn, M, w_.lm_head);
    return logits_dev;
  }

 private:
  Run& r_;
  const K3Config& c_;
  const WeightsDev& w_;
  const std::vector<SegmentDev>& segs_;
  const int32_t* ids_;
  const int64_t N_, D_;
  const bool all_positions_, profile_;
  T* xn_ = nullptr;       // the last mix's output: the next block's input
  float* out_ = nullptr;  // a block output
  Pending pending_;
};

}  // namespace gpu

template <class T>
float* CudaModel::Impl::run_layers(const std::vector<CudaSequenceCache*>& caches,
                                   const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                   const ForwardHooks* hooks) {
  const K3Config& c = cfg;
  std::vector<gpu::SegmentDev> segs;
  std::vector<int32_t> ids;
  int64_t N = 0;
  for (size_t b = 0; b < tokens.size(); ++b) {
    segs.push_back({N, int64_t(tokens[b].size()), &caches[b]->impl()});
    ids.insert(ids.end(), tokens[b].begin(), tokens[b].end());
    N += int64_t(tokens[b].size());
  }
  // The pooled decode (cuda_model_impl.h): the leading sequences of one pool that add one token each to at
  // least 4 cached ones (where a lone decode would take the absorbed form too). BF16 path, not the reference.
  gpu::PooledDecode pooled;
  int64_t P = 0;
  if (precision == GpuPrecision::BF16 && !reference) {
    while (P < int64_t(segs.size()) && segs[size_t(P)].n == 1 && segs[size_t(P)].cache->pool == segs[0].cache->pool &&
           segs[size_t(P)].cache->length >= 4)
      ++P;
  }
  if (P > 0) {  // slots and lengths travel with the ids, in one copy
    pooled.B = P;
    pooled.pool = segs[0].cache->pool.get();
    for (int64_t b = 0; b < P; ++b) ids.push_back(int32_t(segs[size_t(b)].cache->index));
    for (int64_t b = 0; b < P; ++b) {
      const int64_t len = segs[size_t(b)].cache->length;
      K3_CHECK(len < (int64_t(1) << 30), "forward (cuda): a sequence of ", len, " tokens is past the decode's range");
      ids.push_back(int32_t(len));
      pooled.max_p0 = std::max(pooled.max_p0, len);
    }
  }
  arena.reset();
  if constexpr (!std::is_same_v<T, float>) {
    if (N > dispatch_tokens) {
      dispatch = std::make_unique<moe::cuda::Dispatch>(N, std::max<int64_t>(c.num_experts, 1),
                                                       std::max<int64_t>(c.num_experts_per_token, 1));
      dispatch_tokens = N;
    }
  }
  int32_t* ids_dev = arena.take<int32_t>(int64_t(ids.size()));
  cuda::copy_to_device(ids_dev, ids.data(), ids.size() * 4);
  if (P > 0) {
    pooled.slot = ids_dev + N, pooled.p0 = ids_dev + N + P;
    const std::vector<uint16_t*> rows = pooled_rows(*pooled.pool, segs, P, 0);
    auto* rows_dev = static_cast<uint16_t**>(arena.take_bytes(rows.size() * sizeof(rows[0])));
    cuda::copy_to_device(rows_dev, rows.data(), rows.size() * sizeof(rows[0]));
    pooled.rows = rows_dev;
  }
  float* logits = run_step<T>(segs, ids_dev, N, arena, dispatch.get(), P > 0 ? &pooled : nullptr, all_positions, hooks);
  for (const gpu::SegmentDev& s : segs) s.cache->length += s.n;
  return logits;
}

std::vector<uint16_t*> CudaModel::Impl::pooled_rows(gpu::CachePool& pool, const std::vector<gpu::SegmentDev>& segs,
                                                    int64_t P, int64_t bucket) const {
  const int64_t rows_per_layer = std::max(P, bucket);
  std::vector<uint16_t*> out;
  for (size_t l = 0; l < pool.mla.size(); ++l) {
    if (cfg.layer_kind[l] == AttnKind::KDA) continue;
    gpu::MlaPoolDev& mp = pool.mla[l];
    for (int64_t b = 0; b < rows_per_layer; ++b) {
      const int64_t place = b < P ? segs[size_t(b)].cache->index : pool.pad;
      const int64_t need = b < P ? segs[size_t(b)].cache->length + 1 : 5;  // padding: its row 4
      gpu::reserve_rows(mp, place, need, mla_ldc, sizeof(bf16));
      out.push_back(reinterpret_cast<uint16_t*>(mp.rows[size_t(place)].data()));
    }
  }
  return out;
}

template <class T>
float* CudaModel::Impl::run_step(const std::vector<gpu::SegmentDev>& segs, const int32_t* ids_dev, int64_t N,
                                 gpu::DeviceArena& ar, moe::cuda::Dispatch* disp, const gpu::PooledDecode* pooled,
                                 bool all_positions, const ForwardHooks* hooks) {
  gpu::Run run{cfg, precision, *gemm, ar, disp, mla_ldc, hooks, reference, pooled};
  gpu::CudaBackend<T> be(run, w, segs, ids_dev, N, all_positions, profile);
  return decoder_forward(be, cfg, &timings);
}

bool CudaModel::Impl::pick_by_graph(CudaModel& m, const std::vector<CudaSequenceCache*>& caches,
                                    const std::vector<std::vector<int32_t>>& tokens,
                                    const std::vector<TokenPick>& picks, const std::vector<sample::cuda::PickRow>& rows,
                                    std::vector<PickResult>& res) {
  if (!use_graphs || !graphs_off_why.empty() || precision != GpuPrecision::BF16 || reference || profile) return false;
  const int64_t B = int64_t(caches.size()), V = cfg.vocab_size;
  validate(caches, tokens);
  gpu::CachePool* pool = caches[0]->impl().pool.get();
  int64_t max_p0 = 0;
  for (size_t b = 0; b < caches.size(); ++b) {
    const CudaSequenceCache::Impl& c = caches[b]->impl();
    if (tokens[b].size() != 1 || c.pool.get() != pool || c.length < 4) return false;
    max_p0 = std::max(max_p0, c.length);
  }
  if (max_p0 >= (int64_t(1) << 30)) return false;
  const int64_t bucket = gpu::graph_bucket(B);
  std::vector<gpu::SegmentDev> segs(static_cast<size_t>(bucket));
  for (int64_t b = 0; b < bucket; ++b)
    segs[size_t(b)] = gpu::SegmentDev{b, 1, b < B ? &caches[size_t(b)]->impl() : nullptr};
  // Room for this step's rows first (a capture cannot allocate); the table of where they are is an input.
  const std::vector<uint16_t*> table = pooled_rows(*pool, segs, B, bucket);
  // The MLA decode's splits are planned for the largest capacity of the pool when the graph is made: a graph
  // whose plan no longer covers a sequence of the step is made again (capacities grow geometrically).
  int64_t pool_cap = 0;
  for (size_t l = 0; l < pool->mla.size(); ++l)
    for (int64_t cap : pool->mla[l].capacity) pool_cap = std::max(pool_cap, cap);
  if (pool_cap >= (int64_t(1) << 30)) return false;
  gpu::DecodeGraph* g = nullptr;
  for (auto it = graphs.begin(); it != graphs.end();) {
    gpu::DecodeGraph& d = **it;
    const std::shared_ptr<gpu::CachePool> owner = d.pool.lock();
    const bool mine = owner.get() == pool;
    if (!owner || (mine && d.plan_cap < max_p0 + 1)) {  // its pool is gone, or a sequence outgrew its plan
      it = graphs.erase(it);
      continue;
    }
    if (mine && d.bucket == bucket) g = &d;
    ++it;
  }
  // Inputs: the real rows, then padding rows on the pool's padding place.
  std::vector<int32_t> in(size_t(3 * bucket));
  std::vector<sample::cuda::PickRow> pick(static_cast<size_t>(bucket));
  auto fill_padding = [&](int64_t from) {
    for (int64_t b = from; b < bucket; ++b) {
      in[size_t(b)] = 0, in[size_t(bucket + b)] = int32_t(pool->pad), in[size_t(2 * bucket + b)] = 4;
      pick[size_t(b)] = sample::cuda::PickRow{};
    }
  };
  if (!g) {
    auto made = std::make_unique<gpu::DecodeGraph>();
    made->pool = caches[0]->impl().pool;
    made->bucket = bucket;
    made->plan_cap = pool_cap;
    made->in = cuda::DeviceBuffer<int32_t>(size_t(3 * bucket));
    made->table = cuda::DeviceBuffer<uint8_t>(table.size() * sizeof(table[0]));
    made->pick = cuda::DeviceBuffer<uint8_t>(size_t(bucket) * sizeof(sample::cuda::PickRow));
    made->out = cuda::DeviceBuffer<int32_t>(size_t(2 * bucket));
    made->dispatch = std::make_unique<moe::cuda::Dispatch>(bucket, std::max<int64_t>(cfg.num_experts, 1),
                                                           std::max<int64_t>(cfg.num_experts_per_token, 1));
    gpu::PooledDecode pd;
    pd.B = bucket, pd.pool = pool, pd.slot = made->in.data() + bucket, pd.p0 = made->in.data() + 2 * bucket;
    pd.rows = reinterpret_cast<uint16_t* const*>(made->table.data());
    pd.max_p0 = pool_cap - 1;
    gpu::DecodeGraph& d = *made;
    auto body = [&] {
      d.arena.reset();
      d.logits = run_step<bf16>(segs, d.in.data(), bucket, d.arena, d.dispatch.get(), &pd, false, nullptr);
      sample::cuda::pick_tokens(d.logits, bucket, V, reinterpret_cast<const sample::cuda::PickRow*>(d.pick.data()),
                                d.out.data(), d.out.data() + bucket);
    };
    try {
      // A run on padding alone sizes the arena and does every first-use setup (GEMM plans, kernel attributes)
      // outside the capture; the capture then takes the same addresses.
      fill_padding(0);
      const std::vector<uint16_t*> pad_table = pooled_rows(*pool, segs, 0, bucket);
      d.table.upload(reinterpret_cast<const uint8_t*>(pad_table.data()), pad_table.size() * sizeof(pad_table[0]));
      d.in.upload(in.data(), in.size());
      d.pick.upload(reinterpret_cast<const uint8_t*>(pick.data()), pick.size() * sizeof(pick[0]));
      body();
      cuda::synchronize();
      d.arena.reset();
      d.graph = cuda::Graph::capture(body);
    } catch (const Error& e) {
      graphs_off_why = e.what();  // decode runs eagerly from now on
      return false;
    }
    graphs.push_back(std::move(made));
    g = graphs.back().get();
  }
  for (int64_t b = 0; b < B; ++b) {
    in[size_t(b)] = tokens[size_t(b)][0];
    in[size_t(bucket + b)] = int32_t(caches[size_t(b)]->impl().index);
    in[size_t(2 * bucket + b)] = int32_t(caches[size_t(b)]->impl().length);
    pick[size_t(b)] = rows[size_t(b)];
  }
  fill_padding(B);
  std::vector<int32_t> out(size_t(2 * bucket));
  try {
    g->in.upload(in.data(), in.size());
    g->table.upload(reinterpret_cast<const uint8_t*>(table.data()), table.size() * sizeof(table[0]));
    g->pick.upload(reinterpret_cast<const uint8_t*>(pick.data()), pick.size() * sizeof(pick[0]));
    g->graph->launch();
    g->out.download(out.data(), out.size());
  } catch (...) {
    for (CudaSequenceCache* c : caches) c->impl().broken = true;
    throw;
  }
  for (CudaSequenceCache* c : caches) c->impl().length += 1;
  res = pick_results(m, caches, tokens, picks, g->logits, out.data(), out.data() + bucket, false);
  return true;
}

}  // namespace k3
#endif  // K3_HAVE_CUDA
