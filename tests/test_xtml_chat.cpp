// XTML chat rendering against Moonshot's reference encoder, and its token ids against the
// reference tokenizer.
//
// Truths: tests/fixtures/xtml/moonshot_goldens.json (a copy of ../shared/fixtures/xtml-chat, made
// by Moonshot), tests/fixtures/xtml/goldens.json (21 more requests rendered by the reference
// encoding_k3.py, tests/tools/make_xtml_goldens.py), ids.json (those segments encoded by the npm
// tiktoken reference, tests/tools/add_xtml_ids.mjs), kimi_split.json (the reference's long-run
// cuts) and python_json.json (Python's json.dumps / repr spellings).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/temp_dir.h"

using namespace k3;
using k3test::fixture;
using ojson = nlohmann::ordered_json;

namespace {

ojson load(const std::string& rel) {
  std::ifstream in(fixture(rel));
  return ojson::parse(in);
}

std::vector<ChatSegment> segments_of(const ojson& list) {
  std::vector<ChatSegment> out;
  for (const auto& s : list) out.push_back({s["text"].get<std::string>(), s["special"].get<bool>()});
  return out;
}

// o200k ranks with the K3 specials after them (ids.json was made with the same vocabulary).
const Tokenizer& o200k_k3() {
  static Tokenizer t = Tokenizer::load(fixture("tokenizer/o200k.tiktoken"));
  return t;
}

// Segments as the reference encoder lists them: text and kind (the assistant flag is k3cpp's, for SFT; test_sft.cpp
// checks it).
std::vector<ChatSegment> as_reference(std::vector<ChatSegment> segs) {
  for (ChatSegment& s : segs) s.assistant = false;
  return segs;
}

std::string show(const std::vector<ChatSegment>& segs) {
  std::string s;
  for (const auto& g : segs) s += (g.special ? "«" : "[") + g.text + (g.special ? "»" : "]");
  return s;
}

void expect_cases_match(const std::string& rel, int min_cases) {
  const ojson g = load(rel);
  int n = 0;
  for (const auto& [name, c] : g["cases"].items()) {
    const std::vector<ChatSegment> want = segments_of(c["segments"]);
    std::vector<ChatSegment> got;
    try {
      got = as_reference(render_chat(c["input"]));
    } catch (const Error& e) {
      ADD_FAILURE() << name << ": " << e.what();
      continue;
    }
    EXPECT_EQ(got, want) << name << "\n got: " << show(got) << "\nwant: " << show(want);
    ++n;
  }
  EXPECT_GE(n, min_cases);
}

}  // namespace

TEST(XtmlChat, MatchesMoonshotGoldens) { expect_cases_match("xtml/moonshot_goldens.json", 7); }

TEST(XtmlChat, MatchesReferenceEncoderOnMoreRequests) { expect_cases_match("xtml/goldens.json", 21); }

TEST(XtmlChat, RejectsWhatTheReferenceRejects) {
  const ojson g = load("xtml/goldens.json");
  int n = 0;
  for (const auto& [name, c] : g["errors"].items()) {
    EXPECT_THROW(render_chat(c["input"]), Error) << name << " (reference: " << c["error"] << ")";
    ++n;
  }
  EXPECT_EQ(n, 3);
}

TEST(XtmlChat, BadRequestsNameTheField) {
  auto error_of = [](const char* json) {
    try {
      render_chat(ojson::parse(json));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of(R"({"msgs": []})").find("'messages'"), std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"content": "x"}]})").find("messages[0] has no 'role'"), std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "developer", "content": "x"}]})").find("messages[0].role 'developer'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "user", "content": 5}]})").find("messages[0].content"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]})")
                .find("messages[0].tool_calls[0].function has no 'name'"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"messages": [], "thinking": "yes"})").find("'thinking'"), std::string::npos);
  EXPECT_NE(error_of(R"([1, 2])").find("JSON object"), std::string::npos);
}

TEST(XtmlChat, SegmentIdsMatchReferenceTokenizer) {
  const ojson ids = load("xtml/ids.json");
  ASSERT_EQ(ids["num_ranks"].get<int64_t>(), o200k_k3().num_ranks());
  int n = 0;
  for (const auto& [tag, rel] :
       {std::pair{"shared", "xtml/moonshot_goldens.json"}, std::pair{"extra", "xtml/goldens.json"}}) {
    const ojson g = load(rel);
    for (const auto& [name, c] : g["cases"].items()) {
      const std::vector<int32_t> want = ids["ids"][std::string(tag) + ":" + name].get<std::vector<int32_t>>();
      const std::vector<int32_t> got = encode_segments(o200k_k3(), render_chat(c["input"]));
      EXPECT_EQ(got, want) << tag << ":" << name;
      ++n;
    }
  }
  EXPECT_EQ(n, 28);
}

TEST(XtmlChat, WholeStringEncodingWouldDiffer) {
  // The trap of §9: tokenising the rendered prompt in one pass merges across segment boundaries
  // and turns a user's literal "<|open|>" into the control token.
  const ojson g = load("xtml/moonshot_goldens.json");
  const std::vector<ChatSegment> segs = render_chat(g["cases"]["dynamic_tools_named_user"]["input"]);
  const std::vector<int32_t> by_segment = encode_segments(o200k_k3(), segs);
  const std::vector<int32_t> one_pass = o200k_k3().encode(join_segments(segs), /*allow_special=*/true);
  EXPECT_NE(by_segment, one_pass);
  const int32_t open = o200k_k3().special_id(K3Special::kOpen);
  EXPECT_EQ(std::count(one_pass.begin(), one_pass.end(), open) - std::count(by_segment.begin(), by_segment.end(), open),
            1);
  EXPECT_EQ(o200k_k3().decode(by_segment), join_segments(segs));
}

TEST(KimiSplit, MatchesReferenceCuts) {
  const ojson g = load("tokenizer/kimi_split.json");
  for (const auto& c : g["cases"]) {
    std::string text;
    for (const auto& run : c["runs"])
      for (int64_t k = 0; k < run[1].get<int64_t>(); ++k) text += run[0].get<std::string>();
    const size_t max_run = c["max_run"].get<size_t>();
    std::vector<int64_t> got;
    for (const auto& [b, e] : kimi_encode_parts(text, kKimiMaxEncodeChars, max_run)) {
      int64_t chars = 0;  // code points in [b, e)
      for (size_t i = b; i < e; ++i) chars += (uint8_t(text[i]) & 0xc0) != 0x80;
      got.push_back(chars);
    }
    std::vector<int64_t> want = c["part_lengths"].get<std::vector<int64_t>>();
    if (text.empty()) want.clear();  // the reference yields one empty part, which encodes to nothing
    EXPECT_EQ(got, want) << "max_run " << max_run << ", " << text.size() << " bytes";
  }
}

TEST(KimiSplit, LongRunsEncodeAsSeparateParts) {
  // 30,000 'a' are encoded as 25,000 + 5,000: the ids are those of the two parts concatenated.
  const std::string text(30000, 'a');
  std::vector<int32_t> want = o200k_k3().bpe().encode_ordinary(text.substr(0, 25000));
  const std::vector<int32_t> tail = o200k_k3().bpe().encode_ordinary(text.substr(25000));
  want.insert(want.end(), tail.begin(), tail.end());
  EXPECT_EQ(o200k_k3().encode(text, false), want);
  EXPECT_EQ(o200k_k3().decode(want), text);
}

TEST(PythonJson, FloatReprMatchesPython) {
  const ojson g = load("tokenizer/python_json.json");
  int n = 0;
  for (const auto& f : g["floats"]) {
    const uint64_t bits = std::stoull(f[0].get<std::string>(), nullptr, 16);
    double v;
    std::memcpy(&v, &bits, sizeof v);
    EXPECT_EQ(python_float_repr(v), f[1].get<std::string>()) << f[0];
    ++n;
  }
  EXPECT_GT(n, 2000);
}

TEST(PythonJson, DumpsMatchesPython) {
  const ojson g = load("tokenizer/python_json.json");
  for (const auto& d : g["documents"]) {
    const ojson v = ojson::parse(d[0].get<std::string>());
    EXPECT_EQ(python_json_dumps(v, true), d[1].get<std::string>());
    EXPECT_EQ(python_json_dumps(v, false), d[2].get<std::string>());
  }
  EXPECT_EQ(python_json_dumps(deep_sorted(ojson::parse(R"({"b": {"d": 1, "c": 2}, "a": [{"z": 0, "é": 1, "y": 2}]})")),
                              true),
            R"({"a":[{"y":2,"z":0,"é":1}],"b":{"c":2,"d":1}})");
}

TEST(PythonJson, Utf8ReplacementMatchesPython) {
  auto unhex = [](const std::string& h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out += char(std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
  };
  const ojson g = load("tokenizer/python_json.json");
  int n = 0;
  for (const auto& c : g["utf8_replace"]) {
    EXPECT_EQ(to_valid_utf8(unhex(c[0].get<std::string>())), unhex(c[1].get<std::string>())) << c[0];
    ++n;
  }
  EXPECT_EQ(n, 3000);
}

TEST(SpecialTokens, K3TableAndTokenizerConfig) {
  const auto t = k3_special_tokens(163584);
  EXPECT_EQ(t.size(), 256u);
  EXPECT_EQ(t.at("[BOS]"), 163584);
  EXPECT_EQ(t.at("<|end_of_msg|>"), 163586);
  EXPECT_EQ(t.at("<|open|>"), 163587);
  EXPECT_EQ(t.at("<|media_pad|>"), 163605);
  EXPECT_EQ(t.at("<osagent_mode>"), 163649);
  EXPECT_EQ(t.at("[PAD]"), 163839);
  EXPECT_EQ(t.at("<|reserved_token_163592|>"), 163592);
  k3test::TempDir dir("special_tokens");
  const std::string cfg = dir.file("tokenizer_config.json");
  std::ofstream(cfg) << k3_tokenizer_config_json(1000);
  const auto loaded = load_special_tokens(cfg, 1000);
  EXPECT_EQ(loaded, k3_special_tokens(1000));
  std::ofstream(cfg) << R"({"added_tokens_decoder": {"1003": {"content": "<|mine|>"}}})";
  EXPECT_EQ(load_special_tokens(cfg, 1000).at("<|mine|>"), 1003);
  EXPECT_EQ(load_special_tokens(cfg, 1000).at("<|reserved_token_1000|>"), 1000);
  for (const char* bad : {R"({"added_tokens_decoder": {"999": {"content": "x"}}})",  // inside the ranks
                          R"({"added_tokens_decoder": {"12a": {"content": "x"}}})",  // not an id
                          R"({"added_tokens_decoder": {"1001": {}}})",               // no content
                          R"({"added_tokens_decoder": [1]})", "{not json"}) {
    std::ofstream(cfg) << bad;
    EXPECT_THROW(load_special_tokens(cfg, 1000), Error) << bad;
  }
}

TEST(XtmlChatCli, PrintSegmentsAndIds) {
  k3test::TempDir dir("chat_cli");
  const ojson g = load("xtml/moonshot_goldens.json");
  const std::string req = dir.file("req.json");
  std::ofstream(req) << g["cases"]["tools_and_calls"]["input"].dump();
  k3test::Outcome r = k3test::run_k3({"chat-template", "--request", req, "--print-segments"});
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<ChatSegment> got;
  for (size_t pos = 0; pos < r.output.size();) {
    const size_t nl = r.output.find('\n', pos);
    const ojson line = ojson::parse(r.output.substr(pos, nl - pos));
    got.push_back({line["text"].get<std::string>(), line["special"].get<bool>()});
    pos = nl + 1;
  }
  EXPECT_EQ(got, segments_of(g["cases"]["tools_and_calls"]["segments"]));
  // --print-ids with a model directory holding the tokenizer.
  const std::string model = dir.file("tok");
  std::filesystem::create_directories(model);
  std::filesystem::copy_file(fixture("tokenizer/o200k.tiktoken"), model + "/tiktoken.model");
  r = k3test::run_k3({"chat-template", "--request", req, "--print-ids", "--model", model}, "2>/dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  std::string want;
  for (int32_t id : load("xtml/ids.json")["ids"]["shared:tools_and_calls"].get<std::vector<int32_t>>())
    want += (want.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(r.output, want + "\n");
  r = k3test::run_k3({"chat-template", "--request", req, "--print-ids"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--model"), std::string::npos) << r.output;
  std::ofstream(req) << "{\"messages\": [";
  r = k3test::run_k3({"chat-template", "--request", req});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find(req + ": not valid JSON"), std::string::npos) << r.output;
}
