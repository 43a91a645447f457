// The BPE tokenizer against the reference tiktoken (npm `tiktoken`, WebAssembly build of OpenAI's
// implementation) on the o200k_base ranks with Kimi K3's pre-tokenizer pattern. The goldens and the
// rank file are made by tests/tools/make_tokenizer_goldens.mjs.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "util/compare.h"

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
    std::string out;
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int rc = pclose(p);
    return std::make_pair(rc, out);
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
