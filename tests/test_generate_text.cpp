// k3 generate with text prompts and chat requests: the text paths must feed the model exactly the
// ids that the tokenizer / XTML encoder give (checked against the --ids path of the same binary),
// and fail clearly when the model has no tokenizer or a mismatched one.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/temp_dir.h"
#include "util/tiny_tokenizer.h"

using namespace k3;
using k3test::fixture;
using k3test::Outcome;
using k3test::run_k3;

namespace {

// The golden tiny model (vocab 1024) with a 768-rank tokenizer: the first 768 o200k ranks (a BPE
// vocabulary is closed under taking a rank prefix), so the 256 specials end exactly at 1024.
struct TinyWithTokenizer {
  k3test::TempDir dir{"gen_text"};
  TinyWithTokenizer() {
    for (const char* f : {"config.json", "model.safetensors"})
      std::filesystem::create_symlink(fixture(std::string("k3-tiny-a/") + f), dir.path() / f);
    k3test::write_tiny_tokenizer(dir.path());
  }
  std::string path() const { return dir.path().string(); }
};

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) {
    if (!s.empty()) s += ',';
    s += std::to_string(id);
  }
  return s;
}

std::string last_line(const std::string& out) {
  const size_t end = out.find_last_not_of('\n');
  const size_t start = out.rfind('\n', end);
  return out.substr(start == std::string::npos ? 0 : start + 1, end + 1 - (start == std::string::npos ? 0 : start + 1));
}

}  // namespace

TEST(GenerateText, PromptFeedsTheTokenizersIds) {
  TinyWithTokenizer m;
  const Tokenizer tok = Tokenizer::load_dir(m.path());
  EXPECT_EQ(tok.vocab_size(), 1024);
  const std::string text = "Hello world, naïve café";
  const Outcome by_text =
      run_k3({"generate", "--model", m.path(), "--prompt", text, "--max-new-tokens", "6", "--print-ids"},
             "2>/dev/null");
  const Outcome by_ids = run_k3({"generate", "--model", m.path(), "--ids", join_ids(tok.encode(text, false)),
                                 "--max-new-tokens", "6", "--print-ids"},
                                "2>/dev/null");
  ASSERT_EQ(by_text.status, 0) << by_text.output;
  ASSERT_EQ(by_ids.status, 0) << by_ids.output;
  EXPECT_EQ(last_line(by_text.output), last_line(by_ids.output));
  const std::string generated = last_line(by_text.output);
  EXPECT_EQ(std::count(generated.begin(), generated.end(), ' '), 5);
}

TEST(GenerateText, RequestFeedsTheXtmlIdsAndPrintsTheParsedMessage) {
  TinyWithTokenizer m;
  const Tokenizer tok = Tokenizer::load_dir(m.path());
  const std::string req = m.dir.file("req.json");
  const nlohmann::ordered_json body = {{"messages", {{{"role", "user"}, {"content", "Hi there"}}}}};
  std::ofstream(req) << body.dump();
  const std::string prompt_ids = join_ids(encode_segments(tok, render_chat(body)));
  const Outcome by_req =
      run_k3({"generate", "--model", m.path(), "--request", req, "--max-new-tokens", "5", "--print-ids"},
             "2>/dev/null");
  const Outcome by_ids =
      run_k3({"generate", "--model", m.path(), "--ids", prompt_ids, "--max-new-tokens", "5", "--print-ids"},
             "2>/dev/null");
  ASSERT_EQ(by_req.status, 0) << by_req.output;
  EXPECT_EQ(last_line(by_req.output), last_line(by_ids.output));
  const Outcome r = run_k3({"generate", "--model", m.path(), "--request", req, "--max-new-tokens", "5"}, "2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string& report = r.output;
  const size_t at = report.find("\nmessage: ");
  ASSERT_NE(at, std::string::npos) << report;
  const std::string json = report.substr(at + 10, report.find('\n', at + 1) - at - 10);
  const auto msg = nlohmann::json::parse(json);
  EXPECT_EQ(msg["role"], "assistant");
  EXPECT_TRUE(msg.contains("reasoning_content"));  // thinking is the default: the prompt opened think
}

TEST(GenerateText, ClearErrors) {
  TinyWithTokenizer m;
  Outcome r = run_k3({"generate", "--model", fixture("k3-tiny-a"), "--prompt", "hi"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("no tiktoken.model"), std::string::npos) << r.output;
  r = run_k3({"generate", "--model", m.path(), "--prompt", "hi", "--ids", "1,2"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("excludes"), std::string::npos) << r.output;
  // A tokenizer with more ids than the model's vocabulary.
  k3test::TempDir big("gen_text_big");
  std::filesystem::create_symlink(fixture("tokenizer/o200k.tiktoken"), big.path() / "tiktoken.model");
  r = run_k3({"generate", "--model", m.path(), "--tokenizer", big.path().string(), "--prompt", "hi"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("vocab_size is 1024"), std::string::npos) << r.output;
  const std::string req = m.dir.file("bad.json");
  std::ofstream(req) << R"({"messages": [{"role": "user", "content": "x"}], "thinking_effort": "medium"})";
  r = run_k3({"generate", "--model", m.path(), "--request", req});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("thinking_effort 'medium'"), std::string::npos) << r.output;
}
