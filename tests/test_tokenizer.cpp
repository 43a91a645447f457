// The BPE tokenizer against the reference tiktoken (npm `tiktoken`, WebAssembly build of OpenAI's
// implementation) on the o200k_base ranks with Kimi K3's pre-tokenizer pattern. The goldens and the
// rank file are made by tests/tools/make_tokenizer_goldens.mjs.
#include <gtest/gtest.h>

#include <climits>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/plain_bpe.h"

using namespace k3;
using k3test::fixture;

namespace {

const BpeTokenizer& o200k() {
  static BpeTokenizer t = BpeTokenizer::load(fixture("tokenizer/o200k.tiktoken"),
                                             {{"<|open|>", 200100}, {"<|sep|>", 200101}, {"<|close|>", 200102}});
  return t;
}

nlohmann::json goldens() {
  std::ifstream in(fixture("tokenizer/goldens.json"));
  return nlohmann::json::parse(in);
}

}  // namespace

TEST(Tokenizer, PatternIsTheOneTheGoldensUsed) { EXPECT_EQ(goldens()["pattern"].get<std::string>(), kK3Pattern); }

TEST(Tokenizer, IntersectionsAreRewrittenAsLookaheads) {
  EXPECT_EQ(translate_class_intersections("[\\p{Lu}\\p{M}&&[^\\p{Han}]]+"), "(?:(?![\\p{Han}])[\\p{Lu}\\p{M}])+");
  EXPECT_EQ(translate_class_intersections("[^\\s\\]x]+|\\[&&"), "[^\\s\\]x]+|\\[&&");  // no intersection: unchanged
  EXPECT_THROW(translate_class_intersections("[a&&b]"), Error);
}

TEST(Tokenizer, MatchesReferenceTiktokenOnGoldens) {
  const nlohmann::json g = goldens();
  int n = 0;
  for (const auto& c : g["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(o200k().encode_ordinary(text), want) << "text: " << text;
    EXPECT_EQ(o200k().decode(want), text);
    ++n;
  }
  EXPECT_GT(n, 30);
}

TEST(Tokenizer, SpecialsOnlyWhenAllowed) {
  const std::string s = "a<|open|>b<|sep|>";
  const std::vector<int32_t> with = o200k().encode_with_specials(s);
  ASSERT_GE(with.size(), 4u);
  EXPECT_EQ(std::count(with.begin(), with.end(), 200100), 1);
  EXPECT_EQ(with.back(), 200101);
  const std::vector<int32_t> plain = o200k().encode_ordinary(s);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 200100), 0);  // typed text stays text
  EXPECT_EQ(o200k().decode(with), s);
  EXPECT_EQ(o200k().decode(plain), s);
}

TEST(Tokenizer, RoundTripsArbitraryBytes) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s(size_t(rng() % 64), '\0');
    for (char& ch : s) ch = char(rng() % 256);  // mostly invalid UTF-8
    EXPECT_EQ(o200k().decode(o200k().encode_ordinary(s)), s) << "trial " << trial;
  }
}

TEST(Tokenizer, BadRankFileAndIdsAreErrors) {
  EXPECT_THROW(BpeTokenizer::load("/nonexistent/tiktoken.model"), Error);
  EXPECT_THROW(o200k().decode({999999999}), Error);
}

TEST(TokenizerCli, TokenizePrintIdsAndDetokenize) {
  const std::string ranks = fixture("tokenizer/o200k.tiktoken");
  auto run = [](const std::string& cmd) {
    const k3test::Outcome r = k3test::run_shell(cmd);
    return std::make_pair(r.status, r.output);
  };
  auto [rc, out] = run(std::string(K3_BINARY) + " tokenize --ranks " + ranks + " --text 'Hello world' --print-ids");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "13225 2375\n");  // the reference's ids (goldens.json, first case)
  std::tie(rc, out) = run(std::string(K3_BINARY) + " detokenize --ranks " + ranks + " --ids 13225,2375");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "Hello world\n");
  std::tie(rc, out) = run(std::string(K3_BINARY) + " tokenize --ranks /nonexistent/tiktoken.model --text x");
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("error: /nonexistent/tiktoken.model"), std::string::npos) << out;
}

// ---- The optimised encoder against a plain merge loop written here (the CPU twin) ----
// BpeTokenizer merges with a hashed rank table, a stack-array loop for short pieces and a heap for
// pieces over 128 bytes (src/tokenizer/bpe.cpp). The twin (tests/util/plain_bpe.h) reads the rank
// file itself and merges the way tiktoken's byte_pair_merge is specified, with std::string parts and
// a std::unordered_map; only the pre-tokenizer is shared. The random texts mix scripts, marks, digits,
// whitespace, punctuation, emoji and raw (mostly invalid) bytes, and include long runs that reach the
// heap path.

namespace {

const k3test::PlainBpe& plain() {
  static const k3test::PlainBpe p(fixture("tokenizer/o200k.tiktoken"));
  return p;
}

std::vector<int32_t> plain_encode(const std::string& text) { return plain().encode(text); }

// Random text: items drawn from script pools, raw bytes, and now and then a long run of one kind
// (letters, Han, punctuation, spaces, one repeated character) so that pieces exceed 128 bytes.
std::string random_text(std::mt19937& rng) {
  static const std::vector<std::vector<std::string>> pools = {
      {"the", " the", "The", " and", "ing", "tion", " of", "I", "a", "Z", "q", "xyz", "Hello", " world", "'s", "'LL",
       "'d"},
      {" ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", "\u00a0", "\u3000", "\u2028", "\u200b", "\f", "\v"},
      {"0", "7", "42", "123", "9999", "\u00b2", "\u0663", "\u216b", "\uff13"},
      {".", ",", "!", "?", "-", "_", "(", ")", "{", "}", "\"", "'", "/", "\\", "#", "<|open|>", "...", "--", "=="},
      {"\u00e9", "\u00df", "\u00c6", "na\u00efve", "\u0141\u00f3d\u017a", "\u01c5", "\u02b0", "e\u0301", "\u0308",
       "\u0301"},
      {"\u03b1\u03b2\u03b3", "\u0394", "\u0420\u0443\u0441", "\u0442\u0435\u043a\u0441\u0442", "\u0627", "\u0628\u0627",
       "\u05e9", "\u0905", "\u093f", "\u0e01", "\u0e31"},
      {"\u4e2d", "\u56fd", "\u6587", "\u5b66\u4e60", "\u3007", "\u3005", "\u3042", "\u30a2", "\u30fc", "\ud55c",
       "\uad6d\uc5b4"},
      {"\U0001f642", "\U0001f44d\U0001f3fd", "\u200d", "\ufe0f", "\U0001f1ef", "\U0001f1f5", "\u20ac", "\u2211",
       "\u2192"},
  };
  std::string s;
  const int items = 1 + int(rng() % 40);
  for (int k = 0; k < items; ++k) {
    const uint32_t kind = rng() % 100;
    if (kind < 8) {  // raw bytes, mostly not UTF-8
      for (uint32_t n = 1 + rng() % 6; n > 0; --n) s.push_back(char(rng() % 256));
    } else if (kind < 9) {  // a long run
      const uint32_t len = 40 + rng() % 200;
      const uint32_t what = rng() % 6;
      for (uint32_t i = 0; i < len; ++i) {
        if (what == 0) s.push_back(char('a' + rng() % 26));
        else if (what == 1) s += pools[6][rng() % 4];  // Han
        else if (what == 2) s.push_back("-=*_!.~#"[rng() % 8]);
        else if (what == 3) s.push_back(" \t"[rng() % 2]);
        else if (what == 4) s += "a";
        else s += pools[5][rng() % pools[5].size()];  // Greek, Cyrillic, Arabic, Hebrew, Devanagari, Thai
      }
    } else {
      const auto& pool = pools[rng() % pools.size()];
      s += pool[rng() % pool.size()];
    }
  }
  return s;
}

std::string hex_bytes(const std::string& s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    std::snprintf(buf, sizeof buf, "%02x", c);
    out += buf;
  }
  return out;
}

}  // namespace

TEST(Tokenizer, MatchesPlainMergeLoopOnRandomText) {
  std::mt19937 rng(2026);
  int failures = 0;
  size_t long_pieces = 0;
  const PreTokenizer pre;
  for (int trial = 0; trial < 3000 && failures < 5; ++trial) {
    const std::string text = random_text(rng);
    pre.for_each_piece(text, [&](std::string_view p) { long_pieces += p.size() > 128; });
    const std::vector<int32_t> want = plain_encode(text), got = o200k().encode_ordinary(text);
    if (got != want) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      ADD_FAILURE() << "trial " << trial << ": ids differ at index " << i << " (" << got.size() << " vs " << want.size()
                    << " ids); text bytes " << hex_bytes(text);
      ++failures;
    }
    EXPECT_EQ(o200k().decode(got), text) << "trial " << trial;
  }
  EXPECT_GT(long_pieces, 50u);  // the heap path was exercised
}

TEST(Tokenizer, MatchesPlainMergeLoopOnEveryByteLength) {
  // Pieces of 1..40 bytes, each length several times: the rank table reads short strings as
  // overlapping words, so every length takes its own path.
  std::mt19937 rng(11);
  for (size_t len = 1; len <= 40; ++len)
    for (int rep = 0; rep < 20; ++rep) {
      std::string word(len, 'a');
      for (char& c : word) c = char('a' + rng() % 26);
      std::string spaced = word;
      spaced[0] = ' ';  // a leading space, as in " word"
      for (const std::string& text : {word, spaced, std::string(len, "-=*_!.~#"[rng() % 8])})
        EXPECT_EQ(o200k().encode_ordinary(text), plain_encode(text)) << "text '" << text << "'";
    }
}
