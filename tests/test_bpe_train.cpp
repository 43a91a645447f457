// BPE vocabulary training (tokenizer/bpe_train.h, `k3 tokenizer train`) against independent truths:
//  - a naive trainer written here (recounts every pair before every merge, same tie-break) must give
//    the same ranks, pair counts and final segmentations on several small corpora (ASCII with digits
//    and whitespace runs, multi-byte UTF-8 and CJK, invalid UTF-8 bytes, a tie-heavy random text);
//  - merges worked out by hand on the classic hug/pug/pun/bun/hugs example, a tie, and overlaps;
//  - the encoder (Tokenizer::load_dir on the written directory, tiktoken's lowest-rank-first rule)
//    must reproduce the training segmentation of every piece, token for token, on the whole corpus;
//  - the files: RFC 4648 base64 vectors, the rank lines, tokenizer_config.json, specials at N..N+255;
//  - the error paths (messages checked), and the real `k3 tokenizer train` binary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"              // defines: Error
#include "tokenizer/bpe_train.h"     // defines: train_bpe, count_corpus_pieces, train_bpe_on_pieces, ...
#include "tokenizer/pretokenizer.h"  // defines: PreTokenizer, kK3Pattern
#include "tokenizer/tokenizer.h"     // defines: Tokenizer, kimi_encode_parts
#include "util/cli.h"
#include "util/error_of.h"
#include "util/temp_dir.h"  // defines: k3test::TempDir

using namespace k3;
using k3test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

namespace fs = std::filesystem;

using Counts = std::map<std::string, int64_t>;

// ---- independent references ------------------------------------------------------------------

// Pieces of the texts, counted: Kimi's encode cuts, then the pre-tokenizer, single-threaded.
Counts reference_counts(const std::vector<std::string>& texts) {
  const PreTokenizer pre(kK3Pattern);
  Counts c;
  for (const std::string& t : texts)
    for (const auto& [b, e] : kimi_encode_parts(t))
      pre.for_each_piece(std::string_view(t).substr(b, e - b), [&](std::string_view p) { ++c[std::string(p)]; });
  return c;
}

PieceCounts to_piece_counts(const Counts& c) {
  PieceCounts pc;
  for (const auto& [p, n] : c) {
    pc.pieces.emplace_back(p, n);
    pc.corpus_bytes += int64_t(p.size()) * n;
    pc.num_pieces += n;
  }
  return pc;
}

struct NaiveResult {
  std::vector<std::string> tokens;
  std::vector<int64_t> counts;
  std::map<std::string, std::vector<int32_t>> seg;
};

// The definition, as slowly as possible: before every merge count every adjacent pair of every
// piece (x its frequency); take the largest count, the smallest (left, right) among equal counts;
// replace its occurrences left to right. Stops at max_ranks or when the best count < min_count.
NaiveResult naive_train(const Counts& pieces, int64_t max_ranks, int64_t min_count) {
  NaiveResult r;
  for (int b = 0; b < 256; ++b) r.tokens.emplace_back(1, char(b));
  for (const auto& [p, n] : pieces)
    for (char c : p) r.seg[p].push_back(uint8_t(c));
  while (int64_t(r.tokens.size()) < max_ranks) {
    std::map<std::pair<int32_t, int32_t>, int64_t> cnt;
    for (const auto& [p, s] : r.seg)
      for (size_t i = 0; i + 1 < s.size(); ++i) cnt[{s[i], s[i + 1]}] += pieces.at(p);
    std::pair<int32_t, int32_t> best{-1, -1};
    int64_t best_n = 0;
    for (const auto& [pr, n] : cnt)  // ascending (left, right): the first maximum is the tie winner
      if (n > best_n) best = pr, best_n = n;
    if (best_n < min_count || best_n == 0) break;
    const int32_t t = int32_t(r.tokens.size());
    r.tokens.push_back(r.tokens[size_t(best.first)] + r.tokens[size_t(best.second)]);
    r.counts.push_back(best_n);
    for (auto& [p, s] : r.seg) {
      std::vector<int32_t> o;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second) {
          o.push_back(t);
          i += 2;
        } else {
          o.push_back(s[i++]);
        }
      }
      s = o;
    }
  }
  return r;
}

// tiktoken's rule, written out plainly: merge the adjacent pair whose bytes have the lowest rank
// (leftmost on ties) until none is a token.
std::vector<int32_t> naive_encode(const std::string& piece, const std::map<std::string, int32_t>& rank) {
  std::vector<std::string> parts;
  for (char c : piece) parts.emplace_back(1, c);
  for (;;) {
    int32_t best = INT32_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = rank.find(parts[i] + parts[i + 1]);
      if (it != rank.end() && it->second < best) best = it->second, at = i;
    }
    if (best == INT32_MAX) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + int64_t(at) + 1);
  }
  std::vector<int32_t> ids;
  for (const auto& p : parts) ids.push_back(rank.at(p));
  return ids;
}

// ---- corpora ----------------------------------------------------------------------------------

std::string english() {
  std::string s;
  for (int i = 0; i < 12; ++i) {
    s += "The quick brown fox jumps over the lazy dog " + std::to_string(1000 + 37 * i) + " times.\n";
    s += "  In 2026, it's 12345678 tokens; they've said we'll see.\t\tTabs\t and    spaces   \n\n";
    s += "HTTPServer parseJSON x_y = f(a, b) + 3.14159;   // comment\r\n";
  }
  return s;
}

std::string utf8_cjk() {
  std::string s;
  for (int i = 0; i < 8; ++i) {
    s += "naïve café Ünïcödé straße Привет мир, как дела? Ελληνικά 😀😀 emoji "
         "👍🏽 ";
    s += "中文分词测试，中文分词很有趣。日本語のテキストも。한국어 텍스트 ";
    s += i % 2 ? "٣٤٥ १२३ ①②③\n" : "Ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ\n";
  }
  return s;
}

// Bytes from a small set, invalid UTF-8 included (each invalid byte is a piece of its own).
std::string random_bytes(uint32_t seed, size_t n) {
  static const unsigned char kSet[] = {0x00, 0x20, 0x41, 0x42, 0x61, 0x80, 0xc3, 0xa9, 0xff, 0x0a, 0xe4, 0xb8};
  std::mt19937 g(seed);
  std::string s;
  for (size_t i = 0; i < n; ++i) s += char(kSet[g() % sizeof kSet]);
  return s;
}

// Few distinct symbols: many pairs share counts, so the tie-break decides often.
std::string tie_heavy(uint32_t seed, size_t n) {
  static const char* const kBits[] = {"a", "b", "ab", "ba", " ", " a", "\n", "é", "中", "1"};
  std::mt19937 g(seed);
  std::string s;
  while (s.size() < n) s += kBits[g() % 10];
  return s;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

using k3test::error_of;

BpeTrainResult train_counts(const Counts& c, int64_t n, int64_t min_count = 2, bool keep = false) {
  BpeTrainOptions o;
  o.min_pair_count = min_count;
  o.keep_segmentations = keep;
  return train_bpe_on_pieces(to_piece_counts(c), n, o);
}

}  // namespace

// ---- merges worked out by hand ----------------------------------------------------------------

// Pair counts: (u,g) 10+5+5 = 20, (p,u) 17, (u,n) 16, (h,u) 15, (g,s) 5, (b,u) 4 -> "ug".
// Then (u,n) 16, (h,ug) 15, (p,u) 12 -> "un"; then (h,ug) 15, (p,un) 12 -> "hug".
TEST(BpeTrain, ClassicHugPugPunExampleByHand) {
  const BpeTrainResult r = train_counts({{"hug", 10}, {"pug", 5}, {"pun", 12}, {"bun", 4}, {"hugs", 5}}, 259);
  ASSERT_EQ(r.tokens.size(), 259u);
  EXPECT_EQ(r.tokens[256], "ug");
  EXPECT_EQ(r.tokens[257], "un");
  EXPECT_EQ(r.tokens[258], "hug");
  EXPECT_EQ(r.merge_counts, (std::vector<int64_t>{20, 16, 15}));
  for (int b = 0; b < 256; ++b) ASSERT_EQ(r.tokens[size_t(b)], std::string(1, char(b)));
  // hugs: h,u,g,s -> h,ug,s -> hug,s; pun -> p,un; the corpus is 10+5+12+4+5 pieces.
  EXPECT_EQ(r.num_tokens, 10 * 1 + 5 * 2 + 12 * 2 + 4 * 2 + 5 * 2);
}

// Equal counts: the smallest left rank wins, then the smallest right rank.
TEST(BpeTrain, TiesGoToTheSmallestLeftThenRightRank) {
  const BpeTrainResult r = train_counts({{"cd", 3}, {"ac", 3}, {"ab", 3}, {"ba", 3}}, 260);
  EXPECT_EQ(std::vector<std::string>(r.tokens.begin() + 256, r.tokens.end()),
            (std::vector<std::string>{"ab", "ac", "ba", "cd"}));
}

// "aaaa" holds (a,a) three times (overlaps count); merging left to right gives aa,aa, whose pair
// occurs once -- below the default minimum of 2, so the corpus supports 257 ranks.
TEST(BpeTrain, OverlapsCountButMergeLeftToRight) {
  const BpeTrainResult r = train_counts({{"aaaa", 1}}, 257);
  EXPECT_EQ(r.merge_counts, (std::vector<int64_t>{3}));
  EXPECT_EQ(r.num_tokens, 2);  // aa, aa
  EXPECT_THAT(error_of([] {
                train_counts({{"aaaa", 1}}, 258);
              }),
              AllOf(HasSubstr("supports only 257 ranks"), HasSubstr("258 requested"), HasSubstr("at least 2 times")));
  const BpeTrainResult one = train_counts({{"aaaa", 1}}, 258, /*min_count=*/1);
  EXPECT_EQ(one.tokens[257], "aaaa");
  // "aaa": (a,a) twice, then aa,a.
  const BpeTrainResult three = train_counts({{"aaa", 1}}, 258, 1);
  EXPECT_EQ(three.tokens[256], "aa");
  EXPECT_EQ(three.tokens[257], "aaa");
}

// ---- against the naive reference --------------------------------------------------------------

struct CorpusCase {
  std::string name;
  std::vector<std::string> texts;  // one file each
};

std::vector<CorpusCase> corpus_cases() {
  return {
      {"english_digits_whitespace", {english()}},
      {"utf8_cjk", {utf8_cjk(), english().substr(0, 300)}},
      {"invalid_utf8_bytes", {random_bytes(1, 3000), random_bytes(2, 500)}},
      {"tie_heavy", {tie_heavy(3, 2500)}},
      {"mixed_40k", {tie_heavy(5, 20000), english() + utf8_cjk(), random_bytes(6, 8000), english()}},
  };
}

TEST(BpeTrain, MatchesNaiveReferenceTrainer) {
  constexpr int64_t kCap = 256 + 1200;  // bounds the naive trainer's time
  for (const CorpusCase& c : corpus_cases()) {
    TempDir dir("bpe-naive");
    std::vector<std::string> paths;
    for (size_t i = 0; i < c.texts.size(); ++i) {
      paths.push_back(dir.file("part" + std::to_string(i) + ".txt"));
      write_file(paths.back(), c.texts[i]);
    }
    const Counts want_counts = reference_counts(c.texts);
    // Counting: exactly the reference's pieces, whatever the thread count.
    for (int threads : {1, 3}) {
      BpeTrainOptions o;
      o.threads = threads;
      const PieceCounts pc = count_corpus_pieces(paths, kK3Pattern, o);
      const PieceCounts want = to_piece_counts(want_counts);
      EXPECT_EQ(pc.pieces, want.pieces) << c.name << " threads=" << threads;
      EXPECT_EQ(pc.num_pieces, want.num_pieces) << c.name;
      EXPECT_EQ(pc.corpus_bytes, want.corpus_bytes) << c.name;
    }
    for (int64_t min_count : {2, 1}) {
      const NaiveResult ref = naive_train(want_counts, kCap, min_count);
      const int64_t n = int64_t(ref.tokens.size());
      SCOPED_TRACE(c.name + " min_count=" + std::to_string(min_count) + " ranks=" + std::to_string(n));
      EXPECT_GT(n, 256 + 20);
      std::printf("  %s, min_pair_count %lld: %lld ranks%s\n", c.name.c_str(), static_cast<long long>(min_count),
                  static_cast<long long>(n), n < kCap ? " (all the corpus supports)" : "");
      const BpeTrainResult got = train_counts(want_counts, n, min_count, /*keep=*/true);
      ASSERT_EQ(got.tokens.size(), ref.tokens.size());
      for (size_t i = 256; i < ref.tokens.size(); ++i)
        ASSERT_EQ(got.tokens[i], ref.tokens[i])
            << "first different rank " << i << " (count " << ref.counts[i - 256] << ")";
      EXPECT_EQ(got.merge_counts, ref.counts);
      ASSERT_EQ(got.segmentations.size(), ref.seg.size());
      std::map<std::string, int32_t> rank;
      for (size_t i = 0; i < got.tokens.size(); ++i) rank[got.tokens[i]] = int32_t(i);
      for (const auto& [piece, ids] : got.segmentations) {
        EXPECT_EQ(ids, ref.seg.at(piece)) << "piece '" << piece << "'";
        // The crucial property: the encoder's rule reproduces the training segmentation.
        EXPECT_EQ(naive_encode(piece, rank), ids) << "piece '" << piece << "'";
      }
      EXPECT_EQ(got.encoder_mismatches, 0);
      if (n < kCap) {  // the reference stopped: one more rank must be refused, naming n
        EXPECT_THAT(error_of([&] { train_counts(want_counts, n + 1, min_count); }),
                    HasSubstr("supports only " + std::to_string(n) + " ranks"));
      }
    }
  }
}

// ---- the written directory and the encoder ----------------------------------------------------

TEST(BpeTrain, WrittenDirectoryEncodesTheCorpusAsTrained) {
  // 480k characters: more than one of Kimi's 400k-character chunks, cut inside a word, so the
  // pieces at the cut exist only if training cut the text as the encoder does.
  std::string text = utf8_cjk();
  while (text.size() < 480000) text += "abcdefghij ";
  text += english();
  TempDir dir("bpe-dir");
  const std::string corpus = dir.file("corpus.txt");
  write_file(corpus, text);
  BpeTrainOptions o;
  o.keep_segmentations = true;
  o.threads = 2;
  constexpr int64_t kN = 500;
  const BpeTrainResult r = train_bpe({corpus}, kN, kK3Pattern, o);
  ASSERT_EQ(int64_t(r.tokens.size()), kN);
  EXPECT_EQ(r.encoder_mismatches, 0);
  const std::string out = dir.file("tok/nested");
  write_tokenizer_dir(out, r.tokens);

  const Tokenizer tok = Tokenizer::load_dir(out);
  EXPECT_EQ(tok.num_ranks(), kN);
  EXPECT_EQ(tok.vocab_size(), kN + 256);
  EXPECT_EQ(tok.special_id("[BOS]"), kN);
  EXPECT_EQ(tok.special_id("[PAD]"), kN + 255);
  EXPECT_EQ(tok.encode("[EOS]", /*allow_special=*/true), std::vector<int32_t>{int32_t(kN) + 1});
  EXPECT_EQ(read_file(out + "/tokenizer_config.json"), k3_tokenizer_config_json(kN));

  // Encoding the corpus = each piece's training segmentation, in order (pieces from Kimi's cuts).
  std::map<std::string, std::vector<int32_t>> seg(r.segmentations.begin(), r.segmentations.end());
  std::vector<int32_t> want;
  const PreTokenizer pre(kK3Pattern);
  for (const auto& [b, e] : kimi_encode_parts(text))
    pre.for_each_piece(std::string_view(text).substr(b, e - b), [&](std::string_view p) {
      auto it = seg.find(std::string(p));
      if (it == seg.end()) {
        ADD_FAILURE() << "the encoder's piece '" << p << "' was not a training piece";
        return;
      }
      want.insert(want.end(), it->second.begin(), it->second.end());
    });
  const std::vector<int32_t> got = tok.encode(text, false);
  EXPECT_EQ(int64_t(got.size()), r.num_tokens);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(got == want);
  EXPECT_EQ(tok.decode(got), text);

  // Round trip on text it never saw, and on random bytes (invalid UTF-8 included).
  std::mt19937 g(7);
  for (int i = 0; i < 20; ++i) {
    std::string bytes;
    for (int k = 0; k < 300; ++k) bytes += char(g() & 0xff);
    EXPECT_EQ(tok.decode(tok.encode(bytes, false)), bytes);
  }
  const std::string unseen = "Zebras x 99999 \t\n  ⚙️ 新しい";
  EXPECT_EQ(tok.decode(tok.encode(unseen, false)), unseen);
}

// RFC 4648 test vectors, '+' and '/' of the standard alphabet, and the line layout.
TEST(BpeTrain, TiktokenModelLinesAreStandardBase64AndRank) {
  EXPECT_EQ(tiktoken_model_text({"f", "fo", "foo", "foob", "fooba", "foobar", "\xfb\xff"}),
            "Zg== 0\nZm8= 1\nZm9v 2\nZm9vYg== 3\nZm9vYmE= 4\nZm9vYmFy 5\n+/8= 6\n");
  const BpeTrainResult r = train_counts({{"hug", 10}, {"pug", 5}, {"pun", 12}, {"bun", 4}, {"hugs", 5}}, 258);
  const std::string text = tiktoken_model_text(r.tokens);
  std::istringstream in(text);
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    EXPECT_THAT(line, ::testing::EndsWith(std::string(" ").append(std::to_string(n)))) << line;
    ++n;
  }
  EXPECT_EQ(n, 258);
  EXPECT_THAT(text, StartsWith("AA== 0\nAQ== 1\n"));
  EXPECT_THAT(text, HasSubstr("\ndWc= 256\n"));  // "ug"
}

// ---- errors -----------------------------------------------------------------------------------

TEST(BpeTrain, ErrorsNameTheProblem) {
  TempDir dir("bpe-errors");
  const std::string good = dir.file("good.txt"), empty = dir.file("empty.txt"), missing = dir.file("missing.txt");
  write_file(good, english());
  write_file(empty, "");
  const BpeTrainOptions o;
  EXPECT_THAT(error_of([&] { train_bpe({good}, 255, kK3Pattern, o); }),
              AllOf(HasSubstr("vocab size 255"), HasSubstr("256 to ")));
  EXPECT_THAT(error_of([&] { train_bpe({good}, kMaxTrainRanks + 1, kK3Pattern, o); }),
              HasSubstr("vocab size " + std::to_string(kMaxTrainRanks + 1)));
  EXPECT_THAT(error_of([&] {
                train_bpe({good, missing}, 300, kK3Pattern, o);
              }),
              AllOf(HasSubstr(missing), HasSubstr("does not exist")));
  EXPECT_THAT(error_of([&] { train_bpe({dir.path().string()}, 300, kK3Pattern, o); }), HasSubstr("is a directory"));
  EXPECT_THAT(error_of([&] { train_bpe({empty}, 300, kK3Pattern, o); }),
              AllOf(HasSubstr("corpus is empty"), HasSubstr(empty)));
  EXPECT_THAT(error_of([&] { train_bpe({empty, empty}, 256, kK3Pattern, o); }), HasSubstr("corpus is empty"));
  EXPECT_THAT(error_of([&] { train_bpe({}, 300, kK3Pattern, o); }), HasSubstr("no corpus files"));
  EXPECT_THAT(error_of([&] { train_bpe({good}, 100000, kK3Pattern, o); }),
              AllOf(HasSubstr("supports only"), HasSubstr("100000 requested")));
  // 256 ranks need no merge: fine even for one byte.
  write_file(dir.file("one.txt"), "x");
  EXPECT_EQ(train_bpe({dir.file("one.txt")}, 256, kK3Pattern, o).tokens.size(), 256u);
  // Output directory: a file in the way, and a parent that is a file.
  EXPECT_THAT(error_of([&] { prepare_output_dir(good); }), AllOf(HasSubstr(good), HasSubstr("not a directory")));
  EXPECT_THAT(error_of([&] { prepare_output_dir(good + "/sub"); }), HasSubstr("cannot create output directory"));
}

// ---- the k3 binary ----------------------------------------------------------------------------

namespace {

using k3test::Outcome;
using k3test::run_k3;

std::string last_line(const std::string& s) {
  std::string last, l;
  std::istringstream in(s);
  while (std::getline(in, l))
    if (!l.empty()) last = l;
  return last;
}

}  // namespace

TEST(BpeTrainCli, WritesWhatTheLibraryTrains) {
  TempDir dir("bpe-cli");
  const std::string corpus = dir.file("c.txt");
  write_file(corpus, english() + utf8_cjk());
  const std::string out1 = dir.file("a/b"), out3 = dir.file("t3");
  const Outcome r = run_k3({"tokenizer", "train", "--corpus", corpus, "--vocab-size", "400", "--out", out1});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("pre-tokenised"), HasSubstr("merged 144 pairs"), HasSubstr("400 ranks")));
  const BpeTrainResult lib = train_bpe({corpus}, 400, kK3Pattern, BpeTrainOptions{});
  EXPECT_EQ(read_file(out1 + "/tiktoken.model"), tiktoken_model_text(lib.tokens));
  EXPECT_EQ(read_file(out1 + "/tokenizer_config.json"), k3_tokenizer_config_json(400));
  for (const auto& e : fs::directory_iterator(out1))
    EXPECT_THAT(e.path().filename().string(), ::testing::AnyOf("tiktoken.model", "tokenizer_config.json"));
  // Same file with another thread count and the corpus listed twice (every count doubled: the
  // same comparisons, so the same merges while counts stay >= 2).
  const Outcome r3 = run_k3(
      {"tokenizer", "train", "--corpus", corpus, corpus, "--vocab-size", "400", "--out", out3, "--threads", "3"});
  ASSERT_EQ(r3.status, 0) << r3.output;
  EXPECT_EQ(read_file(out3 + "/tiktoken.model"), read_file(out1 + "/tiktoken.model"));
  EXPECT_EQ(Tokenizer::load_dir(out1).special_id(K3Special::kEndOfMsg), 402);
}

TEST(BpeTrainCli, BadInputIsACleanError) {
  TempDir dir("bpe-cli-errors");
  const std::string corpus = dir.file("c.txt"), empty = dir.file("empty.txt"), out = dir.file("out");
  write_file(corpus, english());
  write_file(empty, "");
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> want;  // substrings of the "error:" line
  };
  const std::vector<Case> cases = {
      {{"--corpus", corpus, "--vocab-size", "100", "--out", out}, {"--vocab-size must be in [256,", "got 100"}},
      {{"--corpus", corpus, "--vocab-size", "99999999999", "--out", out}, {"--vocab-size must be in [256,"}},
      {{"--corpus", dir.file("nope.txt"), "--vocab-size", "300", "--out", out},
       {dir.file("nope.txt"), "does not exist"}},
      {{"--corpus", empty, "--vocab-size", "300", "--out", out}, {"corpus is empty", empty}},
      {{"--corpus", corpus, "--vocab-size", "300", "--out", corpus}, {corpus, "not a directory"}},
      {{"--corpus", corpus, "--vocab-size", "300", "--out", corpus + "/x"}, {"cannot create output directory"}},
      {{"--corpus", corpus, "--vocab-size", "90000", "--out", out}, {"supports only", "90000 requested"}},
      {{"--corpus", corpus, "--vocab-size", "300", "--out", out, "--threads", "0"}, {"--threads must be in [1,"}},
      {{"--corpus", corpus, "--vocab-size", "300", "--out", out, "--min-pair-count", "0"}, {"--min-pair-count"}},
      {{"--corpus", corpus, "--vocab-size", "300", "--out", out, "--pattern", "gpt2"}, {"unknown pattern 'gpt2'"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"tokenizer", "train"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const Outcome r = run_k3(args);
    EXPECT_EQ(r.status, 1) << r.output;
    const std::string line = last_line(r.output);
    EXPECT_THAT(line, StartsWith("error: ")) << r.output;
    for (const auto& w : c.want) EXPECT_THAT(line, HasSubstr(w));
    for (const char* bad : {"terminate called", "internal error", "Segmentation"})
      EXPECT_THAT(r.output, ::testing::Not(HasSubstr(bad)));
  }
  EXPECT_FALSE(fs::exists(out + "/tiktoken.model"));  // nothing written by a failed run
  const Outcome help = run_k3({"tokenizer", "train", "--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.output, AllOf(HasSubstr("--corpus"), HasSubstr("--vocab-size"), HasSubstr("--min-pair-count"),
                                 HasSubstr("N..N+255")));
}
