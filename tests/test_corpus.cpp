// The built-in training data (src/data/): the Brown corpus de-tagger against hand-written plain text,
// the corpus reader's errors, the held-out split, and the synthetic retrieval tasks' contract
// (length bound, one needle, the answer recoverable from the prompt, determinism by seed).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>

#include "core/error.h"
#include "data/brown.h"
#include "data/retrieval_tasks.h"
#include "tokenizer/tokenizer.h"
#include "util/compare.h"
#include "util/temp_dir.h"

using namespace k3;
using namespace k3::data;
using k3test::fixture;

namespace {

void write(const std::filesystem::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

// Filler: three documents of numbered sentences, so a prompt's sentences are easy to recognise.
std::vector<std::string> filler_docs() {
  std::vector<std::string> docs;
  for (int d = 0; d < 3; ++d) {
    std::string s;
    for (int i = 0; i < 40; ++i)
      s += "Sentence " + std::to_string(d * 100 + i) + " of the filler says something quite ordinary here.\n";
    docs.push_back(s);
  }
  return docs;
}

const Tokenizer& o200k() {
  static Tokenizer t = Tokenizer::load(fixture("tokenizer/o200k.tiktoken"));
  return t;
}

}  // namespace

TEST(BrownCorpus, PlainTextFromTaggedSample) {
  const std::string tagged =
      "\n\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ``/`` no/at evidence/nn ''/'' ,/, it/pps said/vbd ./.\n"
      "\n\n\tWhy/wrb not/* (/( now/rb )/) ?/. ?/.\n"
      "\tHe/pps met/vbd Ivan/np Allen/np Jr./np ./.\n"
      "\tTwo/cd 1/2/cd inches/nns ;/. ;/.\n"
      "\tSPEED/nn-hl r.p.m./nns-hl ./.-hl\n";
  EXPECT_EQ(brown_plain_text(tagged, "sample"),
            "The Fulton County said \"no evidence\", it said.\n"
            "Why not (now)?\n"
            "He met Ivan Allen Jr.\n"
            "Two 1/2 inches;\n"
            "SPEED r.p.m.\n");
}

TEST(BrownCorpus, MalformedTokenNamesSourceAndLine) {
  try {
    brown_plain_text("\tGood/jj\n\tbad token/nn\n", "corpus/ca99");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("corpus/ca99:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'bad'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(brown_plain_text("word/\n", "x"), Error);
  EXPECT_THROW(brown_plain_text("/nn\n", "x"), Error);
}

TEST(BrownCorpus, ReadsListedSamplesAndSplitsPerGenre) {
  k3test::TempDir dir("brown");
  std::string cats;
  for (int i = 1; i <= 12; ++i) {
    const std::string id = (i <= 8 ? "ca" : "cb") + std::string(i < 10 ? "0" : "") + std::to_string(i);
    cats += id + (i <= 8 ? " news\n" : " editorial\n");
    write(dir.path() / id, "\tSample/nn " + std::to_string(i) + "/cd ./.\n");
  }
  write(dir.path() / "cats.txt", cats);
  const std::vector<BrownDocument> docs = read_brown_corpus(dir.path().string());
  ASSERT_EQ(docs.size(), 12u);
  EXPECT_EQ(docs[0].id, "ca01");
  EXPECT_EQ(docs[0].category, "news");
  EXPECT_EQ(docs[11].text, "Sample 12.\n");
  // every 4th per genre: news ca04, ca08; editorial: the 4th of cb09..cb12 = cb12.
  std::vector<std::string> held;
  for (size_t i = 0; i < docs.size(); ++i)
    if (brown_is_heldout(docs, i, 4)) held.push_back(docs[i].id);
  EXPECT_EQ(held, (std::vector<std::string>{"ca04", "ca08", "cb12"}));
  EXPECT_THROW(brown_is_heldout(docs, 0, 1), Error);

  std::filesystem::remove(dir.path() / "cb10");
  try {
    read_brown_corpus(dir.path().string());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cb10"), std::string::npos) << e.what();
  }
  k3test::TempDir empty("brown_empty");
  EXPECT_THROW(read_brown_corpus(empty.path().string()), Error);  // no cats.txt
}

TEST(RetrievalTasks, PasskeyPromptContract) {
  const RetrievalTaskGenerator gen(o200k(), filler_docs());
  const std::regex needle("The pass key is (\\d{5})\\. Remember it\\. (\\d{5}) is the pass key\\.\n");
  for (int64_t len : {gen.min_tokens(RetrievalTask::Passkey), int64_t(120), int64_t(500), int64_t(2000)}) {
    for (uint64_t seed = 0; seed < 5; ++seed) {
      const RetrievalExample ex = gen.make(RetrievalTask::Passkey, seed, len);
      EXPECT_LE(ex.prompt_tokens, len);
      EXPECT_EQ(ex.prompt_tokens, int64_t(o200k().encode(ex.prompt, false).size()));
      // Filled to within one filler sentence (~15 tokens) of the request.
      EXPECT_GE(ex.prompt_tokens, len - 20) << len;
      auto begin = std::sregex_iterator(ex.prompt.begin(), ex.prompt.end(), needle);
      ASSERT_EQ(std::distance(begin, std::sregex_iterator()), 1) << ex.prompt;
      const std::smatch m = *begin;
      EXPECT_EQ(m[1].str(), m[2].str());
      EXPECT_EQ(ex.answer, " " + m[1].str());
      EXPECT_TRUE(ex.prompt.size() >= 37 &&
                  ex.prompt.substr(ex.prompt.size() - 37) == "What is the pass key? The pass key is");
      EXPECT_GE(ex.depth, 0.0);
      EXPECT_LE(ex.depth, 1.0);
    }
  }
}

TEST(RetrievalTasks, MultiKeyAnswerIsTheQueriedValue) {
  const RetrievalTaskGenerator gen(o200k(), filler_docs());
  const std::regex pair("The code for (\\w+) is (\\d{4})\\.\n");
  const std::regex question("What is the code for (\\w+)\\? The code for (\\w+) is$");
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const RetrievalExample ex = gen.make(RetrievalTask::MultiKey, seed, 400, 5);
    EXPECT_LE(ex.prompt_tokens, 400);
    std::map<std::string, std::string> codes;
    for (auto it = std::sregex_iterator(ex.prompt.begin(), ex.prompt.end(), pair); it != std::sregex_iterator(); ++it)
      EXPECT_TRUE(codes.emplace((*it)[1].str(), (*it)[2].str()).second) << "key twice: " << (*it)[1].str();
    EXPECT_EQ(codes.size(), 5u);
    std::smatch q;
    ASSERT_TRUE(std::regex_search(ex.prompt, q, question)) << ex.prompt;
    EXPECT_EQ(q[1].str(), q[2].str());
    ASSERT_TRUE(codes.count(q[1].str()));
    EXPECT_EQ(ex.answer, " " + codes[q[1].str()]);
  }
}

TEST(RetrievalTasks, DeterministicBySeedAndValidatesArguments) {
  const RetrievalTaskGenerator gen(o200k(), filler_docs());
  const RetrievalExample a = gen.make(RetrievalTask::Passkey, 7, 300);
  const RetrievalExample b = gen.make(RetrievalTask::Passkey, 7, 300);
  const RetrievalExample c = gen.make(RetrievalTask::Passkey, 8, 300);
  EXPECT_EQ(a.prompt, b.prompt);
  EXPECT_EQ(a.answer, b.answer);
  EXPECT_NE(a.prompt, c.prompt);
  EXPECT_THROW(gen.make(RetrievalTask::Passkey, 0, gen.min_tokens(RetrievalTask::Passkey) - 1), Error);
  EXPECT_THROW(gen.make(RetrievalTask::MultiKey, 0, 1000, 0), Error);
  EXPECT_THROW(gen.make(RetrievalTask::MultiKey, 0, 1000, 1000), Error);
  EXPECT_THROW(parse_retrieval_task("needle"), Error);
  EXPECT_EQ(parse_retrieval_task("multikey"), RetrievalTask::MultiKey);
  EXPECT_THROW(RetrievalTaskGenerator(o200k(), {"", ""}), Error);
}
