// Byte-level BPE training; the algorithm and its reasons are in bpe_train.h.
#include "tokenizer/bpe_train.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <queue>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"                // defines: fail, K3_ASSERT
#include "io/input_registry.h"         // defines: register_input
#include "io/output_file.h"            // defines: write_file_atomic
#include "tokenizer/pretokenizer.h"    // defines: PreTokenizer
#include "tokenizer/special_tokens.h"  // defines: k3_tokenizer_config_json
#include "tokenizer/tokenizer.h"       // defines: kimi_encode_parts

namespace k3 {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

template <class... A>
std::string format(const char* f, A... a) {
  char buf[512];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

void report(const BpeTrainOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

// std::string keys looked up by string_view without a copy.
struct ViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
struct ViewEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};
using PieceTable = std::unordered_map<std::string, int64_t, ViewHash, ViewEq>;

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned h = std::thread::hardware_concurrency();
  return h > 0 ? int(h) : 1;
}

void check_corpus_file(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(st)) fail(path, ": corpus file does not exist");
  if (std::filesystem::is_directory(st)) fail(path, ": corpus path is a directory, expected a text file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open corpus file for reading");
}

// Streams (so pipes such as <(zcat x.gz) work too). A regular file is registered as an input, so that
// --out cannot replace a corpus file (io/input_registry.h).
std::string read_corpus_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open corpus file for reading (", std::strerror(errno), ")");
  register_input(fd, path, "corpus file");
  std::string text;
  std::vector<char> buf(static_cast<size_t>(1) << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail(path, ": read error in corpus file (", std::strerror(err), ")");
    }
    if (n == 0) break;
    text.append(buf.data(), size_t(n));
  }
  ::close(fd);
  return text;
}

// Runs fn(worker) on `workers` threads (the caller is worker 0); rethrows the first exception.
void run_workers(int workers, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(workers));
  auto guarded = [&](int w) {
    try {
      fn(w);
    } catch (...) {
      errors[size_t(w)] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int w = 1; w < workers; ++w) threads.emplace_back(guarded, w);
  guarded(0);
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
inline int32_t key_left(uint64_t k) { return int32_t(k >> 32); }
inline int32_t key_right(uint64_t k) { return int32_t(k & 0xffffffffu); }

// A distinct piece during merging: its current symbols are syms[begin, begin + len).
struct Word {
  uint64_t begin;
  uint32_t len;
  int64_t freq;
};

struct PairStat {
  int64_t count = 0;
  std::vector<uint32_t> where;  // words that held the pair when it was added (may be stale)
};

// Max-heap order: larger count first, then the smaller (left rank, right rank); pair_key's layout
// makes that the smaller key.
struct HeapEntry {
  int64_t count;
  uint64_t key;
  bool operator<(const HeapEntry& o) const { return count < o.count || (count == o.count && key > o.key); }
};

// One change to a pair's count from one word; word != kNoWord also adds the word to its index.
struct PairDelta {
  uint64_t key;
  int64_t delta;
  uint32_t word;
};
constexpr uint32_t kNoWord = UINT32_MAX;

// tiktoken's rule on one piece: merge the adjacent pair whose concatenation has the lowest rank
// (leftmost on ties) until no concatenation is a token. Pair ranks are kept in an array and only
// the two neighbours of a merge are looked up again, as tiktoken's byte_pair_merge does.
std::vector<int32_t> encode_piece_reference(std::string_view piece,
                                            const std::unordered_map<std::string, int32_t, ViewHash, ViewEq>& ranks) {
  const size_t n = piece.size();
  std::vector<size_t> start(n + 1);
  for (size_t i = 0; i <= n; ++i) start[i] = i;
  auto rank_at = [&](size_t i) -> int32_t {  // rank of parts i and i+1 joined; INT32_MAX if none
    if (i + 2 >= start.size()) return INT32_MAX;
    auto it = ranks.find(piece.substr(start[i], start[i + 2] - start[i]));
    return it == ranks.end() ? INT32_MAX : it->second;
  };
  std::vector<int32_t> pr(n > 0 ? n - 1 : 0);
  for (size_t i = 0; i < pr.size(); ++i) pr[i] = rank_at(i);
  while (!pr.empty()) {
    size_t at = 0;
    for (size_t i = 1; i < pr.size(); ++i)
      if (pr[i] < pr[at]) at = i;
    if (pr[at] == INT32_MAX) break;
    start.erase(start.begin() + int64_t(at) + 1);
    pr.erase(pr.begin() + int64_t(at));
    if (at < pr.size()) pr[at] = rank_at(at);
    if (at > 0) pr[at - 1] = rank_at(at - 1);
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < start.size(); ++i)
    ids.push_back(ranks.at(std::string(piece.substr(start[i], start[i + 1] - start[i]))));
  return ids;
}

std::string base64_standard(const std::string& in) {
  static const char* const kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const uint32_t v = (uint32_t(uint8_t(in[i])) << 16) | (uint32_t(uint8_t(in[i + 1])) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint32_t(uint8_t(in[i])) << 16) | (uint32_t(uint8_t(in[i + 1])) << 8);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

void check_num_ranks(int64_t num_ranks) {
  if (num_ranks < 256 || num_ranks > kMaxTrainRanks)
    fail("vocab size ", num_ranks, " is out of range: a byte-level vocabulary has 256 to ", kMaxTrainRanks,
         " mergeable ranks (ranks 0..255 are the single bytes)");
}

}  // namespace

void check_corpus_files(const std::vector<std::string>& corpus_paths) {
  if (corpus_paths.empty()) fail("no corpus files given");
  for (const auto& p : corpus_paths) check_corpus_file(p);
}

PieceCounts count_corpus_pieces(const std::vector<std::string>& corpus_paths, const std::string& pattern,
                                const BpeTrainOptions& options) {
  check_corpus_files(corpus_paths);  // all of them before any work
  const PreTokenizer pre(pattern);
  const int threads = resolve_threads(options.threads);
  std::vector<PieceTable> tables(static_cast<size_t>(threads));
  std::vector<int64_t> pieces_per_worker(static_cast<size_t>(threads), 0);
  PieceCounts out;
  const auto t0 = Clock::now();
  // Files are read in batches of about kBatchBytes; the batch's parts (Kimi's encode cuts) are the
  // work items, so even one big file keeps every worker busy.
  constexpr size_t kBatchBytes = size_t(32) << 20;
  size_t next_file = 0;
  while (next_file < corpus_paths.size()) {
    std::vector<std::string> texts;
    size_t batch_bytes = 0;
    while (next_file < corpus_paths.size() && (texts.empty() || batch_bytes < kBatchBytes)) {
      texts.push_back(read_corpus_file(corpus_paths[next_file++]));
      batch_bytes += texts.back().size();
    }
    std::vector<std::string_view> items;  // views into texts, which no longer moves
    for (const std::string& t : texts)
      for (const auto& [b, e] : kimi_encode_parts(t)) items.push_back(std::string_view(t).substr(b, e - b));
    std::atomic<size_t> next_item{0};
    const int workers = std::max(1, std::min<int>(threads, int(items.size())));
    run_workers(workers, [&](int w) {
      PieceTable& table = tables[size_t(w)];
      int64_t n = 0;
      for (size_t i; (i = next_item.fetch_add(1)) < items.size();) {
        pre.for_each_piece(items[i], [&](std::string_view piece) {
          ++n;
          auto it = table.find(piece);
          if (it != table.end()) ++it->second;
          else table.emplace(std::string(piece), 1);
        });
      }
      pieces_per_worker[size_t(w)] += n;
    });
    out.corpus_bytes += int64_t(batch_bytes);
    const double s = seconds_since(t0);
    report(options, format("pre-tokenised %.1f MB (%zu of %zu files) in %.1f s, %.1f MB/s on %d threads",
                           double(out.corpus_bytes) / 1e6, next_file, corpus_paths.size(), s,
                           double(out.corpus_bytes) / 1e6 / std::max(s, 1e-9), threads));
  }
  if (out.corpus_bytes == 0)
    fail("corpus is empty: ",
         corpus_paths.size() == 1 ? corpus_paths[0] + " holds"
                                  : "the " + std::to_string(corpus_paths.size()) + " files hold",
         " no bytes");
  for (size_t w = 1; w < tables.size(); ++w) {
    for (auto& [piece, n] : tables[w]) tables[0][piece] += n;
    PieceTable().swap(tables[w]);
  }
  for (int64_t n : pieces_per_worker) out.num_pieces += n;
  out.pieces.reserve(tables[0].size());
  while (!tables[0].empty()) {
    auto node = tables[0].extract(tables[0].begin());
    out.pieces.emplace_back(std::move(node.key()), node.mapped());
  }
  std::sort(out.pieces.begin(), out.pieces.end());
  report(options, format("%lld pieces, %zu distinct", static_cast<long long>(out.num_pieces), out.pieces.size()));
  return out;
}

BpeTrainResult train_bpe_on_pieces(const PieceCounts& counts, int64_t num_ranks, const BpeTrainOptions& options) {
  check_num_ranks(num_ranks);
  if (options.min_pair_count < 1) fail("min_pair_count must be at least 1, got ", options.min_pair_count);
  if (counts.pieces.empty()) fail("corpus is empty: no pieces to train on");
  const auto t0 = Clock::now();
  BpeTrainResult r;
  r.corpus_bytes = counts.corpus_bytes;
  r.num_pieces = counts.num_pieces;
  r.num_distinct_pieces = int64_t(counts.pieces.size());
  for (int b = 0; b < 256; ++b) r.tokens.emplace_back(1, char(b));

  // Words: the distinct pieces of two bytes or more (one byte has no pair). word_of[p] = its word.
  std::vector<int32_t> syms;
  std::vector<Word> words;
  std::vector<int64_t> word_of(counts.pieces.size(), -1);
  for (size_t p = 0; p < counts.pieces.size(); ++p) {
    const auto& [piece, freq] = counts.pieces[p];
    if (piece.size() < 2) continue;
    if (piece.size() > UINT32_MAX || words.size() >= kNoWord) fail("corpus piece or piece count too large to train on");
    word_of[p] = int64_t(words.size());
    words.push_back({syms.size(), uint32_t(piece.size()), freq});
    for (char c : piece) syms.push_back(uint8_t(c));
  }

  std::unordered_map<uint64_t, PairStat> pairs;
  for (uint32_t w = 0; w < words.size(); ++w) {
    const int32_t* s = syms.data() + words[w].begin;
    for (uint32_t i = 0; i + 1 < words[w].len; ++i) {
      PairStat& ps = pairs[pair_key(s[i], s[i + 1])];
      ps.count += words[w].freq;
      if (ps.where.empty() || ps.where.back() != w) ps.where.push_back(w);
    }
  }
  std::priority_queue<HeapEntry> heap;
  for (const auto& [k, ps] : pairs) heap.push({ps.count, k});

  std::unordered_set<std::string> known(r.tokens.begin(), r.tokens.end());  // guards the no-duplicate argument
  std::vector<PairDelta> deltas;
  auto last_report = Clock::now();
  const int64_t merges_wanted = num_ranks - 256;
  while (int64_t(r.tokens.size()) < num_ranks) {
    // The best pair: pop until an entry's count is current (lazy invalidation, see the header).
    HeapEntry best{0, 0};
    bool found = false;
    while (!heap.empty()) {
      const HeapEntry e = heap.top();
      heap.pop();
      auto it = pairs.find(e.key);
      const int64_t actual = it == pairs.end() ? 0 : it->second.count;
      if (actual == e.count) {
        best = e;
        found = true;
        break;
      }
      if (actual > 0 && actual < e.count) heap.push({actual, e.key});
    }
    if (!found || best.count < options.min_pair_count) break;

    const int32_t a = key_left(best.key), b = key_right(best.key), t = int32_t(r.tokens.size());
    std::string merged = r.tokens[size_t(a)] + r.tokens[size_t(b)];
    K3_ASSERT(known.insert(merged).second);
    r.tokens.push_back(std::move(merged));
    r.merge_counts.push_back(best.count);

    // Replace (a, b) left to right in every word holding it; record the count changes of all the
    // word's pairs (old ones -freq, new ones +freq; unchanged pairs cancel when summed).
    const std::vector<uint32_t> where = std::move(pairs[best.key].where);
    deltas.clear();
    for (uint32_t w : where) {
      Word& wd = words[w];
      int32_t* s = syms.data() + wd.begin;
      const uint32_t n = wd.len;
      bool holds = false;
      for (uint32_t i = 0; i + 1 < n && !holds; ++i) holds = s[i] == a && s[i + 1] == b;
      if (!holds) continue;  // a stale index entry, or a word listed twice
      for (uint32_t i = 0; i + 1 < n; ++i) deltas.push_back({pair_key(s[i], s[i + 1]), -wd.freq, kNoWord});
      uint32_t m = 0;
      for (uint32_t i = 0; i < n; ++m) {
        if (i + 1 < n && s[i] == a && s[i + 1] == b) {
          s[m] = t;
          i += 2;
        } else {
          s[m] = s[i++];
        }
      }
      wd.len = m;
      for (uint32_t i = 0; i + 1 < m; ++i) {
        const bool is_new = s[i] == t || s[i + 1] == t;  // pairs without t were in the word before
        deltas.push_back({pair_key(s[i], s[i + 1]), wd.freq, is_new ? w : kNoWord});
      }
    }
    std::sort(deltas.begin(), deltas.end(), [](const PairDelta& x, const PairDelta& y) {
      return x.key < y.key || (x.key == y.key && x.word < y.word);
    });
    for (size_t i = 0; i < deltas.size();) {
      const uint64_t k = deltas[i].key;
      int64_t sum = 0;
      size_t j = i;
      for (; j < deltas.size() && deltas[j].key == k; ++j) sum += deltas[j].delta;
      if (sum != 0) {
        PairStat& ps = pairs[k];
        for (size_t q = i; q < j; ++q)
          if (deltas[q].word != kNoWord && (ps.where.empty() || ps.where.back() != deltas[q].word))
            ps.where.push_back(deltas[q].word);
        ps.count += sum;
        K3_ASSERT(ps.count >= 0);
        if (ps.count == 0) pairs.erase(k);
        else if (sum > 0) heap.push({ps.count, k});
      }
      i = j;
    }
    K3_ASSERT(pairs.find(best.key) == pairs.end());

    const int64_t done = int64_t(r.tokens.size()) - 256;
    if ((done & 255) == 0 && seconds_since(last_report) >= 2.0) {
      last_report = Clock::now();
      report(options,
             format("merges %lld/%lld, pair count %lld, %.1f s", static_cast<long long>(done),
                    static_cast<long long>(merges_wanted), static_cast<long long>(best.count), seconds_since(t0)));
    }
  }
  if (int64_t(r.tokens.size()) < num_ranks)
    fail("corpus supports only ", r.tokens.size(), " ranks, vocab size ", num_ranks, " requested: after ",
         r.tokens.size() - 256, " merges no adjacent pair occurs at least ", options.min_pair_count, " times (",
         counts.pieces.size(), " distinct pieces in ", counts.corpus_bytes, " bytes); use a vocab size of at most ",
         r.tokens.size(), " or a larger corpus");
  report(options,
         format("merged %lld pairs in %.1f s (last pair count %lld)", static_cast<long long>(merges_wanted),
                seconds_since(t0), static_cast<long long>(r.merge_counts.empty() ? 0 : r.merge_counts.back())));

  // The encoder check (header: "Why the encoder reproduces training"), and the corpus's token count.
  std::unordered_map<std::string, int32_t, ViewHash, ViewEq> ranks;
  for (size_t i = 0; i < r.tokens.size(); ++i) ranks.emplace(r.tokens[i], int32_t(i));
  for (size_t p = 0; p < counts.pieces.size(); ++p) {
    const auto& [piece, freq] = counts.pieces[p];
    std::vector<int32_t> trained;
    if (word_of[p] < 0) {
      trained.push_back(uint8_t(piece[0]));
    } else {
      const Word& wd = words[size_t(word_of[p])];
      trained.assign(syms.begin() + int64_t(wd.begin), syms.begin() + int64_t(wd.begin + wd.len));
    }
    r.num_tokens += freq * int64_t(trained.size());
    if (encode_piece_reference(piece, ranks) != trained) ++r.encoder_mismatches;
    if (options.keep_segmentations) r.segmentations.emplace_back(piece, std::move(trained));
  }
  report(options, format("corpus encodes to %lld tokens (%.2f bytes/token); %lld distinct pieces encode "
                         "differently from training; %.1f s",
                         static_cast<long long>(r.num_tokens),
                         double(r.corpus_bytes) / double(std::max<int64_t>(r.num_tokens, 1)),
                         static_cast<long long>(r.encoder_mismatches), seconds_since(t0)));
  return r;
}

BpeTrainResult train_bpe(const std::vector<std::string>& corpus_paths, int64_t num_ranks, const std::string& pattern,
                         const BpeTrainOptions& options) {
  check_num_ranks(num_ranks);  // before reading a possibly large corpus
  return train_bpe_on_pieces(count_corpus_pieces(corpus_paths, pattern, options), num_ranks, options);
}

std::string tiktoken_model_text(const std::vector<std::string>& tokens) {
  std::string out;
  for (size_t r = 0; r < tokens.size(); ++r) out += base64_standard(tokens[r]) + " " + std::to_string(r) + "\n";
  return out;
}

void write_tiktoken_model(const std::string& path, const std::vector<std::string>& tokens) {
  write_file_atomic(path, tiktoken_model_text(tokens));
}

void prepare_output_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) fail(dir, ": output path exists and is not a directory");
  fs::create_directories(dir, ec);
  if (ec) fail(dir, ": cannot create output directory: ", ec.message());
  const std::string probe = (fs::path(dir) / (".k3-write-probe-" + std::to_string(::getpid()))).string();
  try {
    write_file_atomic(probe, "");
  } catch (const Error& e) {
    fail(dir, ": output directory is not writable (", e.what(), ")");
  }
  fs::remove(probe, ec);
}

void write_tokenizer_dir(const std::string& dir, const std::vector<std::string>& tokens) {
  prepare_output_dir(dir);
  const std::filesystem::path d(dir);
  write_tiktoken_model((d / "tiktoken.model").string(), tokens);
  write_file_atomic((d / "tokenizer_config.json").string(), k3_tokenizer_config_json(int64_t(tokens.size())));
}

}  // namespace k3
