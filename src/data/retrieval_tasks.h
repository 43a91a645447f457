// Synthetic long-context retrieval tasks, generated on the fly: passkey (needle) retrieval and
// multi-key associative recall, hidden in natural filler text.
//
// Both are the standard probes of whether a model can use its whole context: the answer appears
// exactly once, far back, and nothing near the question hints at it. K3 has no positional encoding
// (NoPE MLA, KDA), so the interesting question is how far past its training length it still finds
// the needle; `k3 eval` measures accuracy against prompt length, and the demo mixes these documents
// into the training data so that a tiny model learns the skill at all.
//
//   passkey:   <header> filler… "The pass key is 71432. Remember it. 71432 is the pass key." filler…
//              "What is the pass key? The pass key is"                       answer " 71432"
//   multikey:  <header> filler with K sentences "The code for <word> is <number>." spread through it…
//              "What is the code for <word_j>? The code for <word_j> is"      answer " <number_j>"
//
// Lengths are in tokens of the given tokenizer: a prompt never exceeds the requested length and
// falls short of it by at most one filler sentence. Everything is a function of the seed.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace k3::data {

enum class RetrievalTask { Passkey, MultiKey };
const char* retrieval_task_name(RetrievalTask t);          // "passkey", "multikey"
RetrievalTask parse_retrieval_task(const std::string& s);  // throws k3::Error on an unknown name

struct RetrievalExample {
  std::string prompt;  // ends just before the answer
  std::string answer;  // starts with a space: " 71432"
  int64_t prompt_tokens = 0;
  double depth = 0.0;  // where the (queried) needle sits, as a fraction of the filler
};

// The filler documents at `path`: every *.txt file of a directory, sorted by name (what `k3 corpus
// brown` writes to OUT/train and OUT/heldout), or the one file given. `what` names the option in
// errors (e.g. "--filler"); a missing path, an unreadable file or a directory without documents
// throws k3::Error naming it.
std::vector<std::string> read_filler_documents(const std::string& path, const std::string& what);

class RetrievalTaskGenerator {
 public:
  // `filler_documents`: plain text, one sentence per line (e.g. the Brown training samples). Throws
  // k3::Error if they hold no usable sentence.
  RetrievalTaskGenerator(const Tokenizer& tok, const std::vector<std::string>& filler_documents);

  // A prompt of at most `max_tokens` tokens; throws k3::Error if max_tokens cannot hold the task's
  // fixed text. keys: number of key/value pairs for MultiKey (ignored for Passkey), >= 1.
  RetrievalExample make(RetrievalTask task, uint64_t seed, int64_t max_tokens, int keys = 4) const;

  // The smallest max_tokens make() accepts for this task (its fixed text plus one filler sentence).
  int64_t min_tokens(RetrievalTask task, int keys = 4) const;

 private:
  struct Sentence {
    std::string text;  // with its trailing "\n"
    int64_t tokens;
  };
  int64_t count(const std::string& s) const;
  const Tokenizer& tok_;
  std::vector<std::vector<Sentence>> docs_;  // filler sentences per document, in order
  // Token counts of the fixed text, for min_tokens (counted once, in the constructor): the whole
  // passkey text, and the multikey header, its longest key/value line and longest question over
  // every key word.
  int64_t passkey_fixed_ = 0, multikey_header_ = 0, multikey_line_max_ = 0, multikey_question_max_ = 0;
};

}  // namespace k3::data
