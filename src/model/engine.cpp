#include "model/engine.h"

#include <filesystem>

#include "core/error.h"
#include "dist/group.h"
#include "kernels/loss/cross_entropy.h"
#include "model/training/engine_f64.h"

namespace k3 {

Device parse_device(const std::string& s, const char* what) {
  if (s == "cpu") return Device::CPU;
  if (s == "cuda") return Device::CUDA;
  fail(what, ": expected cpu or cuda, got '", s, "'");
}
Precision parse_precision(const std::string& s, const char* what) {
  if (s == "f32") return Precision::F32;
  if (s == "bf16") return Precision::BF16;
  if (s == "f64") return Precision::F64;
  fail(what, ": expected f32, bf16 or f64, got '", s, "'");
}
const char* device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }
const char* precision_name(Precision p) { return p == Precision::BF16 ? "bf16" : p == Precision::F64 ? "f64" : "f32"; }

void check_restore_chain(const std::vector<const SequenceSnapshot*>& chain, int64_t length) {
  K3_CHECK(length == 0, "restore: the sequence must be fresh, it holds ", length, " tokens");
  K3_CHECK(!chain.empty(), "restore: no snapshots");
  int64_t at = 0;
  for (size_t i = 0; i < chain.size(); ++i) {
    K3_CHECK(chain[i] != nullptr && chain[i]->begin == at && chain[i]->end >= at, "restore: snapshot ", i,
             " does not continue the chain at position ", at);
    at = chain[i]->end;
  }
}

std::string Engine::description() const {
  const EngineOptions o = options();
  return std::string(device_name(o.device)) + " (" + precision_name(o.precision) + ")";
}

namespace {

// A sequence of one engine, tagged with that engine so that another engine refuses it.
template <class Cache>
class SequenceOf : public EngineSequence {
 public:
  SequenceOf(const void* owner, std::unique_ptr<Cache> c) : owner_(owner), cache_(std::move(c)) {}
  int64_t length() const override { return length_of(*cache_); }
  size_t bytes() const override { return cache_->bytes(); }
  Cache* cache(const void* owner, size_t b) {
    K3_CHECK(owner == owner_, "forward: sequence ", b, " was made by another engine");
    return cache_.get();
  }

 private:
  static int64_t length_of(const SequenceCache& c) { return c.length; }
  static int64_t length_of(const CudaSequenceCache& c) { return c.length(); }
  const void* owner_;
  std::unique_ptr<Cache> cache_;
};

template <class Cache>
std::vector<Cache*> caches_of(const void* owner, const std::vector<EngineSequence*>& seqs) {
  std::vector<Cache*> out;
  for (size_t b = 0; b < seqs.size(); ++b) {
    auto* s = dynamic_cast<SequenceOf<Cache>*>(seqs[b]);
    K3_CHECK(s != nullptr, "forward: sequence ", b, " is null or belongs to an engine on another device");
    out.push_back(s->cache(owner, b));
  }
  return out;
}

// A CPU sequence's state as a SequenceCache holding the KDA layers' tails and state and the MLA layers' rows
// [begin, end) only.
struct CpuSnapshot : SequenceSnapshot {
  SequenceCache state;
  size_t bytes() const override { return state.bytes(); }
};

class CpuEngine : public Engine {
 public:
  explicit CpuEngine(std::shared_ptr<Model> m) : m_(std::move(m)) {}
  const K3Config& config() const override { return m_->config(); }
  EngineOptions options() const override {
    return {Device::CPU, m_->options().bf16_activations ? Precision::BF16 : Precision::F32};
  }
  std::string description() const override {
    const dist::Group* g = m_->options().expert_group;
    return Engine::description() + (g && g->size() > 1 ? ", experts over " + std::to_string(g->size()) + " ranks" : "");
  }
  size_t weight_bytes() const override { return m_->weight_bytes(); }
  size_t sequence_bytes(int64_t tokens) const override { return SequenceCache::bytes_at(m_->config(), tokens); }
  std::vector<std::unique_ptr<EngineSequence>> new_sequences(int64_t B) override {
    K3_CHECK(B >= 1, "new_sequences: need at least one sequence, got ", B);
    std::vector<std::unique_ptr<EngineSequence>> out;
    for (int64_t b = 0; b < B; ++b)
      out.push_back(
          std::make_unique<SequenceOf<SequenceCache>>(this, std::make_unique<SequenceCache>(m_->new_cache())));
    return out;
  }
  std::vector<float> forward(const std::vector<EngineSequence*>& seqs, const std::vector<std::vector<int32_t>>& tokens,
                             bool all_positions, const ForwardHooks* hooks) override {
    return m_->forward(caches_of<SequenceCache>(this, seqs), tokens, all_positions, hooks);
  }
  std::unique_ptr<SequenceSnapshot> snapshot(EngineSequence& seq, int64_t rows_from) override {
    const SequenceCache& c = *caches_of<SequenceCache>(this, {&seq})[0];
    K3_CHECK(rows_from >= 0 && rows_from <= c.length, "snapshot: rows_from ", rows_from, " outside [0, ", c.length,
             "]");
    auto s = std::make_unique<CpuSnapshot>();
    s->begin = rows_from;
    s->end = s->state.length = c.length;
    s->state.kda = c.kda;
    const size_t row = size_t(m_->config().kv_lora_rank + m_->config().qk_rope_head_dim);
    for (const MlaLayerCache& m : c.mla)
      s->state.mla.push_back(MlaLayerCache{
          std::vector<float>(m.rows.begin() + std::ptrdiff_t(m.rows.empty() ? 0 : size_t(rows_from) * row),
                             m.rows.end())});
    return s;
  }
  void restore(EngineSequence& seq, const std::vector<const SequenceSnapshot*>& chain) override {
    SequenceCache& c = *caches_of<SequenceCache>(this, {&seq})[0];
    check_restore_chain(chain, c.length);
    for (const SequenceSnapshot* s : chain)
      K3_CHECK(dynamic_cast<const CpuSnapshot*>(s) != nullptr, "restore: a snapshot of another engine");
    const SequenceCache& last = static_cast<const CpuSnapshot&>(*chain.back()).state;
    c.kda = last.kda;
    for (size_t l = 0; l < c.mla.size(); ++l)
      for (const SequenceSnapshot* s : chain) {
        const std::vector<float>& rows = static_cast<const CpuSnapshot&>(*s).state.mla[l].rows;
        c.mla[l].rows.insert(c.mla[l].rows.end(), rows.begin(), rows.end());
      }
    c.length = last.length;
  }
  void reset(EngineSequence& seq) override { *caches_of<SequenceCache>(this, {&seq})[0] = m_->new_cache(); }
  void set_profile(bool on) override { m_->options().profile = on; }
  const BlockTimings& timings() const override { return m_->timings(); }
  void reset_timings() override { m_->reset_timings(); }

 private:
  std::shared_ptr<Model> m_;
};

class CudaEngine : public Engine {
 public:
  explicit CudaEngine(std::shared_ptr<CudaModel> m) : m_(std::move(m)) {}
  const K3Config& config() const override { return m_->config(); }
  EngineOptions options() const override {
    return {Device::CUDA, m_->precision() == GpuPrecision::BF16 ? Precision::BF16 : Precision::F32};
  }
  size_t weight_bytes() const override { return m_->weight_bytes(); }
  size_t sequence_bytes(int64_t tokens) const override { return m_->sequence_bytes(tokens); }
  std::vector<std::unique_ptr<EngineSequence>> new_sequences(int64_t B) override {
    std::vector<std::unique_ptr<EngineSequence>> out;
    for (auto& c : m_->new_caches(B))
      out.push_back(std::make_unique<SequenceOf<CudaSequenceCache>>(this, std::move(c)));
    return out;
  }
  std::vector<float> forward(const std::vector<EngineSequence*>& seqs, const std::vector<std::vector<int32_t>>& tokens,
                             bool all_positions, const ForwardHooks* hooks) override {
    return m_->forward(caches_of<CudaSequenceCache>(this, seqs), tokens, all_positions, hooks);
  }
  struct Snapshot : SequenceSnapshot {
    std::unique_ptr<CudaStateCopy> copy;
    size_t bytes() const override { return copy->bytes(); }
  };
  std::unique_ptr<SequenceSnapshot> snapshot(EngineSequence& seq, int64_t rows_from) override {
    const CudaSequenceCache& c = *caches_of<CudaSequenceCache>(this, {&seq})[0];
    auto s = std::make_unique<Snapshot>();
    s->copy = m_->copy_state(c, rows_from);
    s->begin = rows_from;
    s->end = c.length();
    return s;
  }
  void restore(EngineSequence& seq, const std::vector<const SequenceSnapshot*>& chain) override {
    CudaSequenceCache& c = *caches_of<CudaSequenceCache>(this, {&seq})[0];
    check_restore_chain(chain, c.length());
    std::vector<const CudaStateCopy*> copies;
    for (const SequenceSnapshot* s : chain) {
      const auto* g = dynamic_cast<const Snapshot*>(s);
      K3_CHECK(g != nullptr, "restore: a snapshot of another engine");
      copies.push_back(g->copy.get());
    }
    m_->restore_state(c, copies);
  }
  std::vector<PickResult> forward_pick(const std::vector<EngineSequence*>& seqs,
                                       const std::vector<std::vector<int32_t>>& tokens,
                                       const std::vector<TokenPick>& picks, const ForwardHooks* hooks) override {
    return m_->forward_pick(caches_of<CudaSequenceCache>(this, seqs), tokens, picks, hooks);
  }
  void reset(EngineSequence& seq) override { m_->reset_cache(*caches_of<CudaSequenceCache>(this, {&seq})[0]); }
  void set_profile(bool on) override { m_->set_profile(on); }
  const BlockTimings& timings() const override { return m_->timings(); }
  void reset_timings() override { m_->reset_timings(); }

 private:
  std::shared_ptr<CudaModel> m_;
};

}  // namespace

std::unique_ptr<Engine> Engine::on_cpu(std::shared_ptr<Model> m) { return std::make_unique<CpuEngine>(std::move(m)); }
std::unique_ptr<Engine> Engine::on_gpu(std::shared_ptr<CudaModel> m) {
  return std::make_unique<CudaEngine>(std::move(m));
}

std::unique_ptr<Engine> Engine::load(const std::string& dir, const EngineOptions& o) {
  // Under mpirun every rank loads the model and runs the same tokens; the CPU model shares its routed experts out
  // over the ranks (model/expert_parallel.h).
  dist::Group* experts = dist::launched_by_mpi() && dist::world().size() > 1 ? &dist::world() : nullptr;
  if (experts && (o.precision == Precision::F64 || o.device == Device::CUDA))
    fail("expert parallelism over ", experts->size(), " ranks is built for the CPU model (--device cpu, f32 or bf16); ",
         "the GPU model's over NCCL is not");
  if (o.precision == Precision::F64) {
    if (o.device == Device::CUDA) fail("precision f64: the float64 engine runs on the CPU only");
    const K3Config c = load_config((std::filesystem::path(dir) / "config.json").string());
    return float64_engine(std::make_shared<const train::ParamStore>(train::ParamStore::from_model_dir(dir)), c);
  }
  if (o.device == Device::CUDA)
    return on_gpu(CudaModel::load(dir, o.precision == Precision::BF16 ? GpuPrecision::BF16 : GpuPrecision::F32));
  std::shared_ptr<Model> m = Model::load(dir);
  m->options().bf16_activations = o.precision == Precision::BF16;
  m->options().expert_group = experts;
  return on_cpu(std::move(m));
}

std::vector<float> Engine::forward_fresh(const std::vector<std::vector<int32_t>>& rows, const ForwardHooks* hooks) {
  std::vector<std::unique_ptr<EngineSequence>> seqs = new_sequences(int64_t(rows.size()));  // one pool
  std::vector<EngineSequence*> ptrs;
  for (auto& s : seqs) ptrs.push_back(s.get());
  return forward(ptrs, rows, true, hooks);
}

AppendFn Engine::session() {
  std::shared_ptr<EngineSequence> seq = std::move(new_sequences(1)[0]);
  return [this, seq](const std::vector<int32_t>& t) { return forward({seq.get()}, {t}, false); };
}

PickFn Engine::pick_session(std::vector<InputRows> first_rows) {
  std::shared_ptr<EngineSequence> seq = std::move(new_sequences(1)[0]);
  auto first = std::make_shared<ForwardHooks>();
  if (!first_rows.empty()) first->input_rows = {std::move(first_rows)};
  return [this, seq, first](const std::vector<int32_t>& t, const TokenPick& p) {
    const bool with_rows = !first->input_rows.empty() && seq->length() == 0;
    return std::move(forward_pick({seq.get()}, {t}, {p}, with_rows ? first.get() : nullptr)[0]);
  };
}

std::vector<PickResult> Engine::forward_pick(const std::vector<EngineSequence*>& seqs,
                                             const std::vector<std::vector<int32_t>>& tokens,
                                             const std::vector<TokenPick>& picks, const ForwardHooks* hooks) {
  K3_CHECK(picks.size() == seqs.size(), "forward_pick: ", picks.size(), " picks for ", seqs.size(), " sequences");
  const std::vector<float> logits = forward(seqs, tokens, false, hooks);
  const size_t V = size_t(config().vocab_size);
  std::vector<PickResult> out(seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b)
    if (picks[b].pick || picks[b].want_logits)
      out[b] = pick_on_host(std::vector<float>(logits.begin() + std::ptrdiff_t(b * V),
                                               logits.begin() + std::ptrdiff_t((b + 1) * V)),
                            picks[b]);
  return out;
}

std::vector<double> Engine::sequence_logprobs(const std::vector<int32_t>& ids) {
  K3_CHECK(!ids.empty(), "sequence_logprobs: no tokens");
  const std::vector<float> logits = forward_fresh({ids});
  const size_t V = size_t(config().vocab_size);
  std::vector<double> out(ids.size(), 0.0);
  for (size_t t = 1; t < ids.size(); ++t) out[t] = log_softmax_at(&logits[(t - 1) * V], int64_t(V), ids[t]);
  return out;
}

GenerateResult generate(Engine& e, const std::vector<int32_t>& prompt, int64_t max_new_tokens, Sampler& sampler,
                        const std::function<void(int32_t)>& on_token) {
  return generate(e.pick_session(), e.config(), prompt, max_new_tokens, sampler, on_token);
}

}  // namespace k3
