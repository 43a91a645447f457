// Token shards and packed windows: written and read back exactly, bad files rejected with the file
// named, windows cut at document boundaries.
#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "train/data.h"
#include "util/compare.h"
#include "util/temp_dir.h"

using namespace k3;
using namespace k3::train;

TEST(TrainData, ShardRoundTripAndDocuments) {
  k3test::TempDir dir("shard");
  const Tokenizer tok = Tokenizer::load(k3test::fixture("tokenizer/o200k.tiktoken"));
  std::ofstream(dir.file("a.txt")) << "Hello world";
  std::ofstream(dir.file("b.txt")) << "Second <|open|> document";
  const uint32_t eod = uint32_t(tok.special_id(K3Special::kEndOfMsg));
  const std::vector<uint32_t> ids = tokenize_documents(tok, {dir.file("a.txt"), dir.file("b.txt")}, eod);
  // Independent truth: each file encoded on its own, then the end-of-document id.
  std::vector<uint32_t> want;
  for (const char* text : {"Hello world", "Second <|open|> document"}) {
    for (int32_t id : tok.encode(text, false)) want.push_back(uint32_t(id));
    want.push_back(eod);
  }
  EXPECT_EQ(ids, want);
  write_token_shard(dir.file("s.bin"), ids, eod);
  const TokenShard s = TokenShard::open(dir.file("s.bin"));
  ASSERT_EQ(s.size(), int64_t(ids.size()));
  EXPECT_EQ(s.eod_id(), eod);
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), s.tokens()));
  EXPECT_EQ(s.max_id(), eod);
}

TEST(TrainData, WindowsCutAtDocumentBoundaries) {
  k3test::TempDir dir("window");
  // Documents [1 2 3 E] [4 5 E] [6 E] with E = 9.
  write_token_shard(dir.file("s.bin"), {1, 2, 3, 9, 4, 5, 9, 6, 9}, 9);
  const TokenShard s = TokenShard::open(dir.file("s.bin"));
  using P = std::vector<std::vector<int32_t>>;
  EXPECT_EQ(window_pieces(s, 0, 9), (P{{1, 2, 3, 9}, {4, 5, 9}, {6, 9}}));
  EXPECT_EQ(window_pieces(s, 2, 4), (P{{3, 9}, {4, 5}}));
  EXPECT_EQ(window_pieces(s, 7, 5), (P{{6, 9}, {1, 2, 3}}));  // wraps around the end
  EXPECT_EQ(window_pieces(s, 3, 3), (P{{4, 5}}));             // a lone end-of-document predicts nothing
  EXPECT_THROW(window_pieces(s, 0, 1), Error);
}

TEST(TrainData, BadShardsNameTheFile) {
  k3test::TempDir dir("badshard");
  std::ofstream(dir.file("junk.bin")) << "not a shard at all, just some text";
  try {
    TokenShard::open(dir.file("junk.bin"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("junk.bin: not a k3 token shard"), std::string::npos) << e.what();
  }
  write_token_shard(dir.file("t.bin"), {1, 2, 3, 4}, 4);
  std::filesystem::resize_file(dir.file("t.bin"), 24 + 8);  // cut in the middle of the ids
  try {
    TokenShard::open(dir.file("t.bin"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  EXPECT_THROW(TokenShard::open(dir.file("missing.bin")), Error);
}
