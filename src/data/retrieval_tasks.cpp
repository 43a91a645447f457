#include "data/retrieval_tasks.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/splitmix.h"
#include "io/file.h"

namespace k3::data {

namespace {

struct Rng {
  uint64_t state;
  uint64_t next() { return splitmix64(state++); }  // counter-based: a function of the seed
  uint64_t below(uint64_t n) { return next() % n; }
};

// Key words for multi-key recall: short, common, distinct, each one or two tokens.
const char* const kKeyWords[] = {"apple",  "river",  "stone",  "cloud",  "tiger",  "maple",   "silver", "garden",
                                 "violet", "harbor", "falcon", "copper", "meadow", "lantern", "orange", "candle",
                                 "winter", "pepper", "forest", "marble", "rabbit", "thunder", "velvet", "island"};
constexpr int kNumKeyWords = int(sizeof(kKeyWords) / sizeof(kKeyWords[0]));

const char kPasskeyHeader[] = "There is a pass key hidden in the text below. Find it and remember it.\n";
const char kMultiKeyHeader[] = "Several codes are hidden in the text below. Remember each of them.\n";

std::string number(Rng& r, int digits) {
  std::string s(size_t(digits), '0');
  s[0] = char('1' + r.below(9));
  for (int i = 1; i < digits; ++i) s[size_t(i)] = char('0' + r.below(10));
  return s;
}

}  // namespace

const char* retrieval_task_name(RetrievalTask t) { return t == RetrievalTask::Passkey ? "passkey" : "multikey"; }

RetrievalTask parse_retrieval_task(const std::string& s) {
  if (s == "passkey") return RetrievalTask::Passkey;
  if (s == "multikey") return RetrievalTask::MultiKey;
  fail("unknown retrieval task '", s, "' (expected passkey or multikey)");
}

std::vector<std::string> read_filler_documents(const std::string& path, const std::string& what) {
  std::error_code ec;
  std::vector<std::string> files;
  if (std::filesystem::is_directory(path, ec)) {
    for (const auto& e : std::filesystem::directory_iterator(path))
      if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    if (files.empty())
      fail(what, " ", path, ": the directory holds no .txt documents (expected plain text, one sentence per line, ",
           "e.g. OUT/train or OUT/heldout of `k3 corpus brown --out OUT`)");
  } else if (std::filesystem::is_regular_file(path, ec)) {
    files.push_back(path);
  } else {
    fail(what, " ", path, ": no such file or directory");
  }
  std::vector<std::string> docs;
  for (const std::string& f : files) docs.push_back(read_file(f, "filler document"));
  return docs;
}

int64_t RetrievalTaskGenerator::count(const std::string& s) const { return int64_t(tok_.encode(s, false).size()); }

RetrievalTaskGenerator::RetrievalTaskGenerator(const Tokenizer& tok, const std::vector<std::string>& filler_documents)
    : tok_(tok) {
  for (const std::string& d : filler_documents) {
    std::vector<Sentence> sents;
    size_t pos = 0;
    while (pos < d.size()) {
      const size_t nl = d.find('\n', pos);
      const size_t end = nl == std::string::npos ? d.size() : nl;
      if (end > pos) {
        std::string s = d.substr(pos, end - pos) + "\n";
        const int64_t n = count(s);
        sents.push_back({std::move(s), n});
      }
      pos = end + 1;
    }
    if (!sents.empty()) docs_.push_back(std::move(sents));
  }
  if (docs_.empty()) fail("retrieval tasks: the filler documents hold no sentence");
  passkey_fixed_ = count(kPasskeyHeader) + count("The pass key is 99999. Remember it. 99999 is the pass key.\n") +
                   count("What is the pass key? The pass key is");
  multikey_header_ = count(kMultiKeyHeader);
  for (const char* w : kKeyWords) {
    const std::string word = w;
    multikey_line_max_ = std::max(multikey_line_max_, count("The code for " + word + " is 9999.\n"));
    multikey_question_max_ =
        std::max(multikey_question_max_, count("What is the code for " + word + "? The code for " + word + " is"));
  }
}

int64_t RetrievalTaskGenerator::min_tokens(RetrievalTask task, int keys) const {
  // The fixed text alone (make() accepts an empty filler). The +2 is slack for the random numbers,
  // whose digit groups may take a token more than the 9s counted here.
  if (task == RetrievalTask::Passkey) return passkey_fixed_ + 2;
  return multikey_header_ + keys * multikey_line_max_ + multikey_question_max_ + 2;
}

RetrievalExample RetrievalTaskGenerator::make(RetrievalTask task, uint64_t seed, int64_t max_tokens, int keys) const {
  if (task == RetrievalTask::MultiKey && (keys < 1 || keys > kNumKeyWords))
    fail("retrieval tasks: keys must be in 1..", kNumKeyWords, ", got ", keys);
  const int64_t fixed_min = min_tokens(task, keys);
  if (max_tokens < fixed_min)
    fail("retrieval tasks: ", retrieval_task_name(task), " needs at least ", fixed_min, " tokens, asked for ",
         max_tokens);
  Rng r{splitmix64(seed ^ (task == RetrievalTask::Passkey ? 0x5041u : 0x4D4Bu))};

  // The needles and the question.
  std::vector<std::string> needles;
  std::string header, question, answer;
  size_t queried = 0;
  if (task == RetrievalTask::Passkey) {
    const std::string key = number(r, 5);
    header = kPasskeyHeader;
    needles.push_back("The pass key is " + key + ". Remember it. " + key + " is the pass key.\n");
    question = "What is the pass key? The pass key is";
    answer = " " + key;
  } else {
    header = kMultiKeyHeader;
    std::vector<int> words(kNumKeyWords);
    for (int i = 0; i < kNumKeyWords; ++i) words[size_t(i)] = i;
    for (int i = 0; i < keys; ++i) std::swap(words[size_t(i)], words[size_t(i) + r.below(uint64_t(kNumKeyWords - i))]);
    std::vector<std::string> values;
    for (int i = 0; i < keys; ++i) {
      values.push_back(number(r, 4));
      needles.push_back(std::string("The code for ") + kKeyWords[words[size_t(i)]] + " is " + values.back() + ".\n");
    }
    queried = size_t(r.below(uint64_t(keys)));
    const std::string w = kKeyWords[words[queried]];
    question = "What is the code for " + w + "? The code for " + w + " is";
    answer = " " + values[queried];
  }
  int64_t fixed = count(header) + count(question);
  for (const std::string& n : needles) fixed += count(n);

  // Filler: consecutive sentences from a random document (wrapping to the next one), while they fit.
  std::vector<const Sentence*> filler;
  int64_t budget = max_tokens - fixed - 1;  // 1: slack for a merge across a seam
  size_t d = size_t(r.below(docs_.size()));
  size_t s = size_t(r.below(docs_[d].size()));
  for (size_t guard = 0; budget > 0 && guard < 1000000; ++guard) {
    const Sentence& sent = docs_[d][s];
    if (sent.tokens > budget) break;
    filler.push_back(&sent);
    budget -= sent.tokens;
    if (++s == docs_[d].size()) s = 0, d = (d + 1) % docs_.size();
  }

  // Needle positions: sentence gaps 0..filler.size(), drawn uniformly, in order.
  std::vector<size_t> at(needles.size());
  for (size_t& a : at) a = size_t(r.below(filler.size() + 1));
  std::vector<size_t> order(needles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return at[a] < at[b]; });

  RetrievalExample ex;
  ex.answer = answer;
  for (;;) {
    ex.prompt = header;
    size_t next = 0;
    for (size_t gap = 0; gap <= filler.size(); ++gap) {
      while (next < order.size() && at[order[next]] == gap) ex.prompt += needles[order[next++]];
      if (gap < filler.size()) ex.prompt += filler[gap]->text;
    }
    ex.prompt += question;
    ex.depth = filler.empty() ? 0.0 : double(std::min(at[queried], filler.size())) / double(filler.size());
    ex.prompt_tokens = count(ex.prompt);
    // Token counts of the pieces add up (every piece ends in a newline, which the K3 pattern never
    // merges with a following word), but should a seam ever merge differently, drop filler until it fits.
    if (ex.prompt_tokens <= max_tokens || filler.empty()) break;
    filler.pop_back();
    for (size_t& a : at) a = std::min(a, filler.size());
  }
  if (ex.prompt_tokens > max_tokens)  // the fixed text alone is too long: min_tokens' slack was not enough
    fail("retrieval tasks: this ", retrieval_task_name(task), " prompt needs ", ex.prompt_tokens,
         " tokens without any filler, more than the ", max_tokens, " asked for");
  return ex;
}

}  // namespace k3::data
