// The K3 API contract that Moonshot's Kimi Vendor Verifier checks (serve/openai_api.h), on request bodies and
// over HTTP with the k3-tiny fixture model:
//   - thinking in its three spellings (Moonshot's `thinking: {type, keep, effort}` or a boolean, OpenAI's
//     `reasoning_effort`, the chat template's `chat_template_kwargs: {thinking, preserve_thinking,
//     thinking_effort}`) gives the body render_chat reads; an omitted effort is max; spellings that disagree,
//     an effort without thinking and unknown values are 400s naming the field; keep / preserve_thinking false
//     drops earlier turns' reasoning;
//   - tools declared inside a system message (`messages[].tools`) are declared: rendered, and forced by
//     tool_choice "required"; "required" without tools, an unknown tool_choice and an unknown
//     response_format type are 400s;
//   - K3's fixed sampling (--k3-sampling): temperature 1.0 thinking / 0.6 not, top_p 0.95 whether named or
//     not, other values a 400;
//   - over HTTP: the last streamed chunk carries usage with the exact prompt_tokens, streamed or not; a
//     forced call's arguments follow the system-declared tool's schema.
#include <gtest/gtest.h>

#if defined(K3_HAVE_SERVE)
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "model/engine.h"
#include "serve/openai_api.h"
#include "serve/server.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "util/compare.h"
#include "util/serve_test.h"
#include "util/temp_dir.h"

namespace {

namespace sv = k3::serve;
using json = nlohmann::ordered_json;

const json kUser = json::array({json{{"role", "user"}, {"content", "Hi."}}});

sv::ChatRequest parse(json body, bool k3_sampling = false) {
  if (!body.contains("messages")) body["messages"] = kUser;
  return sv::parse_chat_request_body(body.dump(), sv::ApiLimits{"", 512, k3_sampling});
}

// The 400's param, or "" when the body parses.
std::string refused(const json& body, bool k3_sampling = false) {
  try {
    parse(body, k3_sampling);
    return "";
  } catch (const sv::ApiError& e) {
    EXPECT_EQ(e.status, 400) << e.what();
    return e.param.empty() ? "?" : e.param;
  }
}

}  // namespace

TEST(ServeK3Contract, ThinkingSpellingsGiveTheRenderedFields) {
  struct Case {
    json fields;
    bool thinking;
    std::string effort;
  };
  const Case cases[] = {
      {json::object(), true, "max"},
      {{{"thinking", true}}, true, "max"},
      {{{"thinking", false}}, false, ""},
      {{{"thinking", {{"type", "disabled"}}}}, false, ""},
      {{{"thinking", {{"type", "enabled"}, {"effort", "low"}}}}, true, "low"},
      {{{"reasoning_effort", "high"}}, true, "high"},
      {{{"thinking_effort", "low"}}, true, "low"},
      {{{"chat_template_kwargs", {{"thinking", false}}}}, false, ""},
      {{{"chat_template_kwargs", {{"thinking", true}, {"thinking_effort", "high"}}}}, true, "high"},
      {{{"thinking", {{"type", "enabled"}, {"effort", "high"}}}, {"reasoning_effort", "high"}}, true, "high"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fields.dump());
    const sv::ChatRequest r = parse(c.fields);
    EXPECT_EQ(r.thinking, c.thinking);
    EXPECT_EQ(r.effort, c.effort);
    EXPECT_EQ(r.body["thinking"], c.thinking);
    EXPECT_EQ(r.body.contains("thinking_effort"), c.thinking);
    if (c.thinking) {
      EXPECT_EQ(r.body["thinking_effort"], c.effort);
    }
    for (const char* gone : {"chat_template_kwargs", "reasoning_effort"}) EXPECT_FALSE(r.body.contains(gone));
    // What render_chat makes of it: an effort message exactly when thinking.
    const std::vector<k3::ChatSegment> seg = k3::render_chat(r.body);
    bool effort_message = false;
    for (const k3::ChatSegment& s : seg) effort_message = effort_message || s.text == "thinking-effort";
    EXPECT_EQ(effort_message, c.thinking);
  }
}

TEST(ServeK3Contract, ThinkingSpellingsThatDisagreeAreRefused) {
  EXPECT_EQ(refused({{"thinking", {{"type", "enabled"}, {"effort", "high"}}}, {"reasoning_effort", "low"}}),
            "reasoning_effort");
  EXPECT_EQ(refused({{"thinking", true}, {"chat_template_kwargs", {{"thinking", false}}}}),
            "chat_template_kwargs.thinking");
  EXPECT_EQ(refused({{"thinking", false}, {"reasoning_effort", "high"}}), "reasoning_effort");
  EXPECT_EQ(refused({{"reasoning_effort", "medium"}}), "reasoning_effort");
  EXPECT_EQ(refused({{"thinking", {{"type", "auto"}}}}), "thinking.type");
  EXPECT_EQ(refused({{"thinking", "yes"}}), "thinking");
  EXPECT_EQ(refused({{"thinking", {{"type", "enabled"}, {"keep", "no"}}}}), "thinking.keep");
  EXPECT_EQ(refused({{"chat_template_kwargs", "thinking"}}), "chat_template_kwargs");
  EXPECT_EQ(refused({{"chat_template_kwargs", {{"thinking_effort", "huge"}}}}), "chat_template_kwargs.thinking_effort");
}

TEST(ServeK3Contract, KeepFalseDropsEarlierReasoning) {
  const json history = json::array({json{{"role", "user"}, {"content", "Hi."}},
                                    json{{"role", "assistant"}, {"content", "Hello."}, {"reasoning_content", "R"}},
                                    json{{"role", "user"}, {"content", "And?"}}});
  for (const json& fields : {json{{"thinking", {{"type", "enabled"}, {"keep", false}}}},
                             json{{"chat_template_kwargs", {{"preserve_thinking", false}}}}}) {
    json body = fields;
    body["messages"] = history;
    EXPECT_FALSE(parse(body).body["messages"][1].contains("reasoning_content")) << fields.dump();
  }
  json kept = {{"messages", history}};
  EXPECT_EQ(parse(kept).body["messages"][1]["reasoning_content"], "R");
}

TEST(ServeK3Contract, ToolsDeclaredInSystemMessagesAreDeclared) {
  const json tool = {
      {"type", "function"},
      {"function",
       {{"name", "get_weather"},
        {"parameters",
         {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}, {"required", {"city"}}}}}}};
  const json messages = json::array({json{{"role", "system"}, {"content", "Tools below."}, {"tools", {tool}}},
                                     json{{"role", "user"}, {"content", "Weather in Paris?"}}});
  const sv::ChatRequest r = parse({{"messages", messages}, {"tool_choice", "required"}});
  ASSERT_EQ(r.forced.size(), 1u);
  EXPECT_EQ(r.forced[0].name, "get_weather");
  bool declared = false;
  for (const k3::ChatSegment& s : k3::render_chat(r.body)) declared = declared || s.text == "tool-declare";
  EXPECT_TRUE(declared);
  EXPECT_EQ(refused({{"tool_choice", "required"}}), "tool_choice");
  EXPECT_EQ(refused({{"tool_choice", "required"}, {"tools", json::array()}}), "tool_choice");
  EXPECT_EQ(refused({{"tool_choice", "sometimes"}}), "tool_choice");
  EXPECT_EQ(refused({{"response_format", {{"type", "yaml"}}}}), "response_format.type");
}

TEST(ServeK3Contract, K3SamplingIsFixed) {
  const sv::ChatRequest think = parse(json::object(), true);
  EXPECT_FALSE(think.gen.sampling.greedy);
  EXPECT_FLOAT_EQ(think.gen.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(think.gen.sampling.top_p, 0.95f);
  const sv::ChatRequest plain = parse({{"thinking", {{"type", "disabled"}}}, {"top_p", 0.95}}, true);
  EXPECT_FLOAT_EQ(plain.gen.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(plain.gen.sampling.top_p, 0.95f);
  EXPECT_EQ(refused({{"temperature", 0.7}}, true), "temperature");
  EXPECT_EQ(refused({{"temperature", 0.6}}, true), "temperature") << "0.6 is the value without thinking";
  EXPECT_EQ(refused({{"thinking", false}, {"temperature", 1.0}}, true), "temperature");
  EXPECT_EQ(refused({{"top_p", 0.9}}, true), "top_p");
  EXPECT_EQ(refused({{"top_k", 40}}, true), "top_k");
  EXPECT_EQ(refused({{"n", 2}}, true), "n");
  EXPECT_EQ(refused({{"temperature", 1.0}, {"top_p", 0.95}, {"presence_penalty", 0}}, true), "");
  // Without the mode, the request's own values hold.
  EXPECT_FLOAT_EQ(parse({{"temperature", 0.7}}).gen.sampling.temperature, 0.7f);
  // Completions sample as a turn without thinking.
  const sv::CompletionRequest c =
      sv::parse_completion_request_body(json{{"prompt", "x"}}.dump(), sv::ApiLimits{"", 512, true});
  EXPECT_FLOAT_EQ(c.gen.sampling.temperature, 0.6f);
  EXPECT_THROW(sv::parse_completion_request_body(json{{"prompt", "x"}, {"temperature", 0}}.dump(),
                                                 sv::ApiLimits{"", 512, true}),
               sv::ApiError);
}

// Over HTTP: the finish chunk carries usage (prompt_tokens exact: the non-streamed reply's), with or without
// stream_options.include_usage.
TEST(ServeK3Contract, TheLastStreamedChunkCarriesUsage) {
  k3test::TempDir dir("serve-k3-contract");
  sv::ServeOptions o;
  o.model_id = "k3-tiny";
  k3test::ServeOnLoopback server(k3test::write_tiny_tokenizer(dir), o);
  httplib::Client c = server.client();
  const json body = {{"messages", kUser}, {"max_tokens", 6}, {"temperature", 0}, {"reasoning_effort", "low"}};
  auto plain = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200) << plain->body;
  const json want = json::parse(plain->body)["usage"];
  json streamed = body;
  streamed["stream"] = true;
  auto s = c.Post("/v1/chat/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(s);
  json last_choice_chunk;
  for (size_t pos = 0; (pos = s->body.find("data: ", pos)) != std::string::npos; pos += 6) {
    const size_t end = s->body.find("\n\n", pos);
    const std::string data = s->body.substr(pos + 6, end - pos - 6);
    if (data == "[DONE]") break;
    const json j = json::parse(data);
    if (!j["choices"].empty()) last_choice_chunk = j;
  }
  ASSERT_TRUE(last_choice_chunk.is_object()) << s->body;
  EXPECT_FALSE(last_choice_chunk["choices"][0]["finish_reason"].is_null());
  for (const char* k : {"prompt_tokens", "completion_tokens", "total_tokens"})
    EXPECT_EQ(last_choice_chunk["usage"][k], want[k]) << s->body;
}

#else
TEST(ServeK3Contract, NeedsTheHttpServer) { GTEST_SKIP() << "this build has no HTTP server (libcpp-httplib-dev)"; }
#endif  // K3_HAVE_SERVE
