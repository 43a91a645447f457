// Evaluation of a trained K3 checkpoint with the inference engine (`k3 eval`):
//   - held-out loss and perplexity over a token shard, in windows cut at document boundaries
//     exactly as training cuts them (train/data.h window_pieces);
//   - expert load per MoE layer on those windows (the routed top-k choices of every token);
//   - long-context retrieval accuracy (passkey, multi-key recall) against prompt length, by greedy
//     decoding and exact match.
// Everything here is deterministic: fixed windows, fixed seeds, greedy decoding.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/retrieval_tasks.h"
#include "model/engine.h"
#include "tokenizer/tokenizer.h"
#include "train/data.h"

namespace k3::eval {

// Sum over positions t = 0..n-2 of -log softmax(logits[t])[next[t]], for `rows` rows of `vocab`
// logits each, where row t predicts next[t]. Computed in double with the max subtracted.
double nll_sum(const float* logits, int64_t rows, int64_t vocab, const int32_t* next);

// Counts of routed assignments per (MoE layer, expert), fed by ForwardHooks::topk.
class ExpertLoad {
 public:
  explicit ExpertLoad(const K3Config& c);
  // Adds rows x k expert ids of layer `layer` (0-based model layer; must be an MoE layer).
  void add(int64_t layer, const int32_t* idx, int64_t rows, int64_t k);
  // A hook that feeds add(); chain it into ForwardHooks::topk.
  ForwardHooks hooks();

  struct LayerStats {
    int64_t layer = 0;            // 0-based model layer
    int64_t assignments = 0;      // tokens x k
    std::vector<int64_t> counts;  // [E]
    std::vector<double> share;    // [E] counts / assignments
    double max_vio = 0.0;         // max count / mean count - 1 (mean = assignments / E)
    double min_share = 0.0, max_share = 0.0;
    int64_t unused_experts = 0;  // experts that got no assignment
  };
  std::vector<LayerStats> stats() const;  // one entry per MoE layer, in layer order
  const std::vector<int64_t>& moe_layers() const { return layers_; }
  int64_t num_experts() const { return E_; }

 private:
  int64_t E_ = 0;
  std::vector<int64_t> layers_;               // MoE layer indices
  std::vector<int64_t> slot_;                 // model layer -> index into counts_, or -1
  std::vector<std::vector<int64_t>> counts_;  // [moe layer][E]
};

// Statistics of one counts vector (exposed for tests): fills share/max_vio/min/max/unused.
ExpertLoad::LayerStats load_stats(int64_t layer, const std::vector<int64_t>& counts);

struct HeldoutResult {
  int64_t tokens = 0;  // shard tokens evaluated
  int64_t window = 0;  // window length (the training length)
  int64_t windows = 0;
  int64_t sequences = 0;         // document pieces run
  int64_t predictions = 0;       // next-token predictions scored
  double loss = 0.0;             // mean NLL, nats per predicted token
  double perplexity = 0.0;       // exp(loss)
  double unigram_entropy = 0.0;  // nats per token of the evaluated tokens' own unigram distribution
  double seconds = 0.0;
};

// Mean next-token NLL over the first min(max_tokens, shard size) tokens, in consecutive windows of
// `window` tokens (the last one shorter), each cut into document pieces; every piece is its own
// sequence with a fresh cache (the pieces of a window run as one batch). `load`, when given,
// counts the routed experts of every token. `progress` is called after each window with
// (tokens done, tokens total).
HeldoutResult heldout_loss(Engine& m, const train::TokenShard& shard, int64_t max_tokens, int64_t window,
                           ExpertLoad* load = nullptr, const std::function<void(int64_t, int64_t)>& progress = {});

// Exact match of the decoded continuation against the answer (both taken verbatim).
bool exact_match(const std::string& decoded, const std::string& answer);

struct RetrievalSample {
  uint64_t seed = 0;
  int64_t prompt_tokens = 0;
  double depth = 0.0;
  std::string answer, output;
  bool correct = false;
};

struct RetrievalPoint {
  std::string task;    // "passkey" / "multikey"
  int64_t length = 0;  // requested prompt length (tokens)
  int64_t samples = 0, correct = 0;
  double accuracy = 0.0;
  double mean_depth = 0.0;
  double mean_prompt_tokens = 0.0;
  double seconds = 0.0;
  bool skipped = false;  // the length cannot hold the task's fixed text
  std::string note;
  std::vector<RetrievalSample> details;
};

// The seed of sample i of a task at a length: fixed, so runs are reproducible.
uint64_t retrieval_seed(data::RetrievalTask task, int64_t length, int64_t i);

// Greedy continuations of `max_new` tokens after each prompt, batched (every prompt its own cache).
std::vector<std::vector<int32_t>> greedy_continuations(Engine& m, const std::vector<std::vector<int32_t>>& prompts,
                                                       int64_t max_new);

// `samples` prompts of at most `length` tokens; greedy-decodes as many tokens as the answer has
// (encoded on its own) and compares the decoded text with the answer exactly.
RetrievalPoint retrieval_accuracy(Engine& m, const Tokenizer& tok, const data::RetrievalTaskGenerator& gen,
                                  data::RetrievalTask task, int64_t length, int64_t samples, int keys = 4);

}  // namespace k3::eval
