// Parsing generated XTML back into think / response / tool calls. Truth: the request that was
// rendered (render -> tokenize -> parse must give the same structured calls back), and for
// truncated output, the invariant that every prefix parses into a prefix of the full result.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "tokenizer/xtml_parse.h"
#include "util/compare.h"

using namespace k3;
using k3test::fixture;
using ojson = nlohmann::ordered_json;

namespace {

const Tokenizer& tok() {
  static Tokenizer t = Tokenizer::load(fixture("tokenizer/o200k.tiktoken"));
  return t;
}

const char* kArgs = R"({"query": "say \"hi\" & <|open|> 中文 👍", "k": 3, "ratio": 0.1, "big": 1e20, "flag": true,
  "off": false, "nothing": null, "obj": {"z": 1, "a": [1, 2, {"y": "ü"}]}, "arr": [1, "two", null], "empty": ""})";

// A conversation whose last message is the assistant turn under test.
ojson conversation(const ojson& assistant, bool thinking = true) {
  return {{"messages", ojson::array({{{"role", "user"}, {"content", "go"}}, assistant})},
          {"thinking", thinking},
          {"add_generation_prompt", false}};
}

ojson assistant_with_calls() {
  return {{"role", "assistant"},
          {"reasoning_content", "I need two tools; <|close|> is just text here."},
          {"content", "Calling them now."},
          {"tool_calls",
           ojson::array(
               {{{"id", "a"}, {"type", "function"}, {"function", {{"name", "search"}, {"arguments", kArgs}}}},
                {{"id", "b"},
                 {"type", "function"},
                 {"function", {{"name", "we\"ird&name"}, {"arguments", "{\"x\": -2.5e-07}"}}}},
                {{"id", "c"}, {"type", "function"}, {"function", {{"name", "raw"}, {"arguments", "{not json"}}}}})}};
}

// The ids the model would generate after the generation prompt: the full rendering minus the
// rendering of the history with the prompt (segments are tokenised separately, so the latter's
// ids are an exact prefix of the former's).
std::vector<int32_t> generated_ids(const ojson& assistant, bool thinking = true) {
  const ojson full = conversation(assistant, thinking);
  ojson prompt = full;
  prompt["messages"].erase(1);
  prompt["add_generation_prompt"] = true;
  const std::vector<int32_t> all = encode_segments(tok(), render_chat(full));
  const std::vector<int32_t> head = encode_segments(tok(), render_chat(prompt));
  EXPECT_TRUE(std::equal(head.begin(), head.end(), all.begin())) << "prompt ids are not a prefix";
  return {all.begin() + int64_t(head.size()), all.end()};
}

}  // namespace

TEST(XtmlParse, ToolCallRoundTrip) {
  const std::vector<int32_t> ids = generated_ids(assistant_with_calls());
  const XtmlAssistantMessage m = parse_assistant(xtml_pieces_from_ids(tok(), ids), XtmlStart::kThink);
  EXPECT_TRUE(m.complete);
  EXPECT_TRUE(m.warnings.empty()) << m.warnings.front();
  EXPECT_TRUE(m.has_think);
  EXPECT_EQ(m.think, "I need two tools; <|close|> is just text here.");
  EXPECT_EQ(m.response, "Calling them now.");
  ASSERT_EQ(m.tool_calls.size(), 3u);
  EXPECT_EQ(m.tool_calls[0].name, "search");
  EXPECT_EQ(m.tool_calls[0].index, 1);
  EXPECT_EQ(m.tool_calls[0].arguments, ojson::parse(kArgs));  // same values, same types, same order
  EXPECT_EQ(m.tool_calls[0].arguments.dump(), ojson::parse(kArgs).dump());
  EXPECT_EQ(m.tool_calls[1].name, "we\"ird&name");
  EXPECT_EQ(m.tool_calls[1].arguments, ojson::parse("{\"x\": -2.5e-07}"));
  EXPECT_EQ(m.tool_calls[2].name, "raw");
  ASSERT_TRUE(m.tool_calls[2].raw_arguments.has_value());
  EXPECT_EQ(*m.tool_calls[2].raw_arguments, "{not json");
  for (const auto& c : m.tool_calls) EXPECT_TRUE(c.complete);
  // The OpenAI form carries the arguments as JSON strings that parse back to the same objects.
  const ojson o = m.to_openai();
  EXPECT_EQ(ojson::parse(o["tool_calls"][0]["function"]["arguments"].get<std::string>()), ojson::parse(kArgs));
  EXPECT_EQ(o["content"], "Calling them now.");
  // Rendering the parsed message again gives the same ids.
  ojson again = o;
  EXPECT_EQ(generated_ids(again), ids);
}

TEST(XtmlParse, ResponseChannelWithoutThinking) {
  const ojson a = {{"role", "assistant"}, {"content", "plain answer with a literal <|open|> in it"}};
  const std::vector<int32_t> ids = generated_ids(a, /*thinking=*/false);
  const XtmlAssistantMessage m = parse_assistant(xtml_pieces_from_ids(tok(), ids), XtmlStart::kResponse);
  EXPECT_TRUE(m.complete);
  EXPECT_FALSE(m.has_think);
  EXPECT_EQ(m.response, "plain answer with a literal <|open|> in it");  // BPE text, not a control id
  EXPECT_TRUE(m.tool_calls.empty());
  EXPECT_TRUE(m.warnings.empty());
}

TEST(XtmlParse, TruncatedOutputParsesToAPrefix) {
  const std::vector<int32_t> ids = generated_ids(assistant_with_calls());
  const XtmlAssistantMessage full = parse_assistant(xtml_pieces_from_ids(tok(), ids), XtmlStart::kThink);
  ASSERT_EQ(ids.back(), tok().special_id(K3Special::kEndOfMsg));
  size_t complete_calls_seen = 0;
  for (size_t n = 0; n <= ids.size(); ++n) {
    const std::vector<int32_t> prefix(ids.begin(), ids.begin() + int64_t(n));
    const XtmlAssistantMessage m = parse_assistant(xtml_pieces_from_ids(tok(), prefix), XtmlStart::kThink);
    // Text channels only grow, and are prefixes of the final text (cut at a token boundary, which may
    // split a UTF-8 character, so compare bytes).
    EXPECT_EQ(full.think.compare(0, m.think.size(), m.think), 0) << n;
    EXPECT_EQ(full.response.compare(0, m.response.size(), m.response), 0) << n;
    ASSERT_LE(m.tool_calls.size(), full.tool_calls.size()) << n;
    size_t complete = 0;
    for (size_t c = 0; c < m.tool_calls.size(); ++c) {
      EXPECT_EQ(m.tool_calls[c].index, full.tool_calls[c].index);
      if (m.tool_calls[c].complete) {
        ++complete;
        EXPECT_EQ(m.tool_calls[c].arguments, full.tool_calls[c].arguments) << n;
      }
    }
    EXPECT_GE(complete, complete_calls_seen) << n;  // a call, once complete, stays complete
    complete_calls_seen = complete;
    // Complete from <|close|>message<|sep|> on (the final <|end_of_msg|> adds nothing).
    EXPECT_EQ(m.complete, n >= ids.size() - 1) << n;
  }
  EXPECT_EQ(complete_calls_seen, 3u);
}

TEST(XtmlParse, FromRenderedText) {
  const ojson a = {{"role", "assistant"},
                   {"reasoning_content", "r"},
                   {"content", "c"},
                   {"tool_calls", ojson::array({{{"function", {{"name", "f"}, {"arguments", "{\"n\": [1, 2]}"}}}}})}};
  const std::vector<ChatSegment> segs = render_chat(conversation(a));
  const std::string text = join_segments(segs);
  const size_t body = text.rfind("role=\"assistant\"<|sep|>") + std::string("role=\"assistant\"<|sep|>").size();
  const XtmlAssistantMessage m = parse_assistant(xtml_pieces_from_text(text.substr(body)), XtmlStart::kMessageBody);
  EXPECT_TRUE(m.complete);
  EXPECT_EQ(m.think, "r");
  EXPECT_EQ(m.response, "c");
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_EQ(m.tool_calls[0].arguments, ojson::parse("{\"n\": [1, 2]}"));
}

TEST(XtmlParse, MalformedOutputIsKeptWithWarnings) {
  auto parse_text = [](const std::string& s) { return parse_assistant(xtml_pieces_from_text(s), XtmlStart::kThink); };
  XtmlAssistantMessage m = parse_text("thinking<|open|>response<|sep|>answer<|end_of_msg|>");  // think never closed
  EXPECT_EQ(m.think, "thinking");
  EXPECT_EQ(m.response, "answer");
  EXPECT_TRUE(m.complete);
  EXPECT_FALSE(m.warnings.empty());
  m = parse_text(
      "t<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"x\"<|sep|>"
      "<|open|>argument key=\"n\" type=\"number\"<|sep|>1.5.2<|close|>argument<|sep|>");
  ASSERT_EQ(m.tool_calls.size(), 1u);
  EXPECT_FALSE(m.tool_calls[0].complete);
  EXPECT_EQ(m.tool_calls[0].arguments["n"], "1.5.2");  // not JSON: kept as text
  EXPECT_EQ(m.tool_calls[0].index, 1);
  EXPECT_GE(m.warnings.size(), 2u);
  EXPECT_FALSE(m.complete);
  m = parse_text("<|sep|><|close|><|open|><|open|>x<|sep|><|close|>y<|sep|><|end_of_msg|><|end_of_msg|>");
  EXPECT_TRUE(m.complete);
}

TEST(XtmlParse, RandomPiecesNeverThrow) {
  // The fuzz target does this at scale (fuzz/fuzz_chat_parse.cpp); here a quick seeded sample.
  std::mt19937 rng(11);
  const char* words[] = {"<|open|>",
                         "<|close|>",
                         "<|sep|>",
                         "<|end_of_msg|>",
                         "think",
                         "response",
                         "tools",
                         "call",
                         " tool=\"f\"",
                         " index=\"2\"",
                         "argument",
                         " key=\"k\"",
                         " type=\"number\"",
                         "json",
                         "message",
                         "12",
                         "{\"a\":",
                         "\"",
                         "x",
                         " "};
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s;
    for (int k = int(rng() % 40); k > 0; --k) s += words[rng() % (sizeof words / sizeof *words)];
    for (XtmlStart st : {XtmlStart::kThink, XtmlStart::kResponse, XtmlStart::kMessageBody})
      EXPECT_NO_THROW(parse_assistant(xtml_pieces_from_text(s), st).to_openai().dump()) << s;
  }
}
