#include "eval/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "train/quantile_balance.h"

namespace k3::eval {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int32_t argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return int32_t(best);
}

}  // namespace

double nll_sum(const float* logits, int64_t rows, int64_t vocab, const int32_t* next) {
  double sum = 0.0;
  for (int64_t t = 0; t < rows; ++t) {
    const float* r = logits + t * vocab;
    if (next[t] < 0 || next[t] >= vocab)
      fail("nll_sum: target id ", next[t], " is outside the vocabulary (", vocab, ")");
    float mx = r[0];
    for (int64_t v = 1; v < vocab; ++v) mx = std::max(mx, r[v]);
    double z = 0.0;
    for (int64_t v = 0; v < vocab; ++v) z += std::exp(double(r[v]) - double(mx));
    sum += std::log(z) - (double(r[next[t]]) - double(mx));
  }
  return sum;
}

ExpertLoad::ExpertLoad(const K3Config& c) : E_(c.num_experts) {
  slot_.assign(size_t(c.num_hidden_layers), -1);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (c.is_moe_layer(l)) {
      slot_[size_t(l)] = int64_t(layers_.size());
      layers_.push_back(l);
      counts_.emplace_back(size_t(E_), 0);
    }
}

void ExpertLoad::add(int64_t layer, const int32_t* idx, int64_t rows, int64_t k) {
  if (layer < 0 || layer >= int64_t(slot_.size()) || slot_[size_t(layer)] < 0)
    fail("expert load: layer ", layer, " is not an MoE layer");
  std::vector<int64_t>& c = counts_[size_t(slot_[size_t(layer)])];
  for (int64_t i = 0; i < rows * k; ++i) {
    if (idx[i] < 0 || idx[i] >= E_)
      fail("expert load: expert id ", idx[i], " outside 0..", E_ - 1, " at layer ", layer);
    ++c[size_t(idx[i])];
  }
}

ForwardHooks ExpertLoad::hooks() {
  ForwardHooks h;
  h.topk = [this](int64_t layer, const int32_t* idx, int64_t rows, int64_t k) { add(layer, idx, rows, k); };
  return h;
}

ExpertLoad::LayerStats load_stats(int64_t layer, const std::vector<int64_t>& counts) {
  ExpertLoad::LayerStats s;
  s.layer = layer;
  s.counts = counts;
  for (int64_t n : counts) s.assignments += n;
  s.share.assign(counts.size(), 0.0);
  if (counts.empty() || s.assignments == 0) return s;
  const double total = double(s.assignments);
  int64_t mx = counts[0], mn = counts[0];
  for (size_t e = 0; e < counts.size(); ++e) {
    s.share[e] = double(counts[e]) / total;
    mx = std::max(mx, counts[e]);
    mn = std::min(mn, counts[e]);
    if (counts[e] == 0) ++s.unused_experts;
  }
  s.max_vio = train::max_violation(counts);  // the same MaxVio the trainer logs
  s.min_share = double(mn) / total;
  s.max_share = double(mx) / total;
  return s;
}

std::vector<ExpertLoad::LayerStats> ExpertLoad::stats() const {
  std::vector<LayerStats> out;
  for (size_t i = 0; i < layers_.size(); ++i) out.push_back(load_stats(layers_[i], counts_[i]));
  return out;
}

HeldoutResult heldout_loss(Engine& m, const train::TokenShard& shard, int64_t max_tokens, int64_t window,
                           ExpertLoad* load, const std::function<void(int64_t, int64_t)>& progress) {
  if (window < 2) fail("held-out evaluation: the window must be at least 2 tokens, got ", window);
  if (max_tokens < 2) fail("held-out evaluation: at least 2 tokens are needed, got ", max_tokens);
  if (shard.size() < 2) fail("held-out evaluation: the shard holds ", shard.size(), " tokens (need at least 2)");
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t V = m.config().vocab_size;
  HeldoutResult r;
  r.tokens = std::min(max_tokens, shard.size());
  r.window = window;
  ForwardHooks hooks;
  if (load) hooks = load->hooks();
  double sum = 0.0;
  for (int64_t pos = 0; pos + 2 <= r.tokens; pos += window) {
    const std::vector<std::vector<int32_t>> pieces = train::window_pieces(shard, pos, std::min(window, r.tokens - pos));
    ++r.windows;
    if (!pieces.empty()) {
      const std::vector<float> logits = m.forward_fresh(pieces, load ? &hooks : nullptr);
      int64_t row0 = 0;
      for (const auto& p : pieces) {
        const int64_t n = int64_t(p.size());
        sum += nll_sum(logits.data() + row0 * V, n - 1, V, p.data() + 1);
        r.predictions += n - 1;
        row0 += n;
      }
      r.sequences += int64_t(pieces.size());
    }
    if (progress) progress(std::min(pos + window, r.tokens), r.tokens);
  }
  r.loss = sum / double(std::max<int64_t>(r.predictions, 1));
  r.perplexity = std::exp(r.loss);
  r.unigram_entropy = train::unigram_entropy(shard.tokens(), r.tokens);
  r.seconds = seconds_since(t0);
  return r;
}

bool exact_match(const std::string& decoded, const std::string& answer) { return decoded == answer; }

uint64_t retrieval_seed(data::RetrievalTask task, int64_t length, int64_t i) {
  // Distinct per (task, length, sample) and independent of the other lengths asked for.
  return (uint64_t(task == data::RetrievalTask::Passkey ? 1 : 2) << 56) ^ (uint64_t(length) << 20) ^ uint64_t(i);
}

std::vector<std::vector<int32_t>> greedy_continuations(Engine& m, const std::vector<std::vector<int32_t>>& prompts,
                                                       int64_t max_new) {
  const int64_t V = m.config().vocab_size;
  const size_t B = prompts.size();
  std::vector<std::vector<int32_t>> out(B);
  if (B == 0 || max_new <= 0) return out;
  for (size_t b = 0; b < B; ++b)
    if (prompts[b].empty()) fail("greedy decoding: prompt ", b, " is empty");
  const std::vector<std::unique_ptr<EngineSequence>> seqs = m.new_sequences(int64_t(B));
  std::vector<EngineSequence*> ptrs;
  for (const auto& q : seqs) ptrs.push_back(q.get());
  std::vector<float> logits = m.forward(ptrs, prompts, false);
  for (int64_t step = 0; step < max_new; ++step) {
    std::vector<std::vector<int32_t>> next(B);
    for (size_t b = 0; b < B; ++b) {
      const int32_t id = argmax(logits.data() + int64_t(b) * V, V);
      out[b].push_back(id);
      next[b] = {id};
    }
    if (step + 1 < max_new) logits = m.forward(ptrs, next, false);
  }
  return out;
}

RetrievalPoint retrieval_accuracy(Engine& m, const Tokenizer& tok, const data::RetrievalTaskGenerator& gen,
                                  data::RetrievalTask task, int64_t length, int64_t samples, int keys) {
  const auto t0 = std::chrono::steady_clock::now();
  RetrievalPoint p;
  p.task = data::retrieval_task_name(task);
  p.length = length;
  const int64_t need = gen.min_tokens(task, keys);
  if (length < need) {
    p.skipped = true;
    p.note = "length " + std::to_string(length) + " is below the task's minimum of " + std::to_string(need) + " tokens";
    return p;
  }
  // Batches of at most ~64k prompt tokens, so long lengths do not hold every sample's activations at once.
  constexpr int64_t kBatchTokens = 65536;
  std::vector<std::vector<int32_t>> prompts, answers;
  for (int64_t i = 0; i < samples; ++i) {
    RetrievalSample s;
    s.seed = retrieval_seed(task, length, i);
    const data::RetrievalExample ex = gen.make(task, s.seed, length, keys);
    s.answer = ex.answer;
    s.depth = ex.depth;
    prompts.push_back(tok.encode(ex.prompt, false));
    answers.push_back(tok.encode(ex.answer, false));
    s.prompt_tokens = int64_t(prompts.back().size());
    p.details.push_back(std::move(s));
  }
  size_t b0 = 0;
  while (b0 < prompts.size()) {
    size_t b1 = b0;
    int64_t tokens = 0;
    int64_t max_new = 0;
    while (b1 < prompts.size() && (b1 == b0 || tokens + int64_t(prompts[b1].size()) <= kBatchTokens)) {
      tokens += int64_t(prompts[b1].size());
      max_new = std::max<int64_t>(max_new, int64_t(answers[b1].size()));
      ++b1;
    }
    const std::vector<std::vector<int32_t>> batch(prompts.begin() + int64_t(b0), prompts.begin() + int64_t(b1));
    const std::vector<std::vector<int32_t>> gen_ids = greedy_continuations(m, batch, max_new);
    for (size_t b = b0; b < b1; ++b) {
      std::vector<int32_t> ids(gen_ids[b - b0].begin(), gen_ids[b - b0].begin() + int64_t(answers[b].size()));
      RetrievalSample& s = p.details[b];
      // Ids past the tokenizer (the model's vocabulary may be larger) cannot be decoded: shown as <id>.
      bool all_known = true;
      for (int32_t id : ids) all_known = all_known && id < tok.vocab_size();
      std::string text;
      if (all_known) {
        text = tok.decode(ids);  // together: a multi-byte character may span tokens
      } else {
        for (int32_t id : ids) {
          if (id < tok.vocab_size()) {
            text += tok.decode({id});
          } else {
            text += '<';
            text += std::to_string(id);
            text += '>';
          }
        }
      }
      s.output = text;
      s.correct = exact_match(text, s.answer);
    }
    b0 = b1;
  }
  for (const RetrievalSample& s : p.details) {
    p.correct += s.correct ? 1 : 0;
    p.mean_depth += s.depth;
    p.mean_prompt_tokens += double(s.prompt_tokens);
  }
  p.samples = int64_t(p.details.size());
  if (p.samples > 0) {
    p.accuracy = double(p.correct) / double(p.samples);
    p.mean_depth /= double(p.samples);
    p.mean_prompt_tokens /= double(p.samples);
  }
  p.seconds = seconds_since(t0);
  return p;
}

}  // namespace k3::eval
