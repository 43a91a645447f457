// `k3 serve` (serve/server.h) end to end over HTTP on the loopback, with the k3-tiny fixture model
// on the CPU and a tokenizer of the first 768 o200k ranks (+256 specials = the fixture's 1024 ids):
//   - greedy chat and text completions produce exactly the tokens the engine's own generate() makes
//     for the same prompt ids (the independent truth for the serving loop), and usage counts them:
//     prompt_tokens equal to the ids render_chat + encode_segments (or the tokenizer) give;
//   - a streamed response (server-sent events) carries the same reasoning, content and finish reason
//     as the plain one, chunk by chunk, then the usage chunk and [DONE];
//   - stop strings cut the text before their first occurrence (finish_reason "stop"), streamed too;
//   - bad requests get OpenAI's error body with the right status and the offending field named;
//     an API key, when set, is required everywhere but /health; /metrics counts what was served;
//     an oversized body, bytes that are not UTF-8, 10,000 messages and a client hanging up mid-stream
//     each get a 4xx or a clean close, and the server goes on serving;
//   - a second request while one streams, with no queue allowed, gets 429; past --request-timeout a
//     generating request stops (finish_reason "length") and a waiting one gets 503 (a scripted
//     engine with slow steps: tests/util/scripted_engine.h);
//   - logprobs (chat: logprobs + top_logprobs; completions: logprobs N) are the log_softmax of the
//     logits the engine's own session gives for the same tokens, with the most probable alternatives
//     in order; streamed, the chunks' entries put together equal the plain response's;
//   - constrained decoding on the fixture's random weights: a json_schema reply is a document the
//     schema accepts (checked field by field), a json_object reply an object (or, cut by max_tokens,
//     a prefix of one), tool_choice "none" never calls a tool, "required" or a named function makes
//     exactly one call whose arguments the tool's schema accepts, streamed or not; the JSON automaton
//     agrees with nlohmann's parser on thousands of random strings, and unsupported schema keywords
//     are a 400 naming them;
//   - the official OpenAI client (npm openai) drives the server as a black box
//     (tests/tools/serve_openai_client.mjs: streaming, json_schema and tool arguments validated with
//     ajv, logprobs, completions, errors).
// The pure parsing helpers (utf8_complete_prefix, find_stop, stop_holdback) are checked on strings.
#include <gtest/gtest.h>

#if defined(K3_HAVE_SERVE)
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "serve/json_matcher.h"
#include "serve/logprobs.h"
#include "serve/openai_api.h"
#include "serve/server.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "tokenizer/xtml_parse.h"
#include "util/compare.h"
#include "util/scripted_engine.h"
#include "util/serve_test.h"
#include "util/temp_dir.h"

namespace {

using json = nlohmann::ordered_json;
namespace sv = k3::serve;

using Running = k3test::ServeOnLoopback;
std::string write_tokenizer(const k3test::TempDir& dir) { return k3test::write_tiny_tokenizer(dir); }

class Serve : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new k3test::TempDir("serve");
    tok_dir_ = new std::string(write_tokenizer(*dir_));
    sv::ServeOptions o;
    o.model_id = "k3-tiny";
    o.default_max_tokens = 16;
    o.max_prompt_tokens = 8192;
    running_ = new Running(*tok_dir_, o);
    tok_ = new k3::Tokenizer(k3::Tokenizer::load_dir(*tok_dir_));
    engine_ = k3::Engine::load(k3test::fixture("k3-tiny-a"), k3::EngineOptions{}).release();
  }
  static void TearDownTestSuite() {
    delete running_;
    delete engine_;
    delete tok_;
    delete tok_dir_;
    delete dir_;
  }

  static httplib::Result post(const char* path, const json& body, const httplib::Headers& h = {}) {
    return running_->client().Post(path, h, body.dump(), "application/json");
  }
  // The greedy tokens the engine itself makes after these prompt ids.
  static std::vector<int32_t> greedy(const std::vector<int32_t>& prompt, int64_t n) {
    k3::Sampler s(k3::SamplingParams{});
    return k3::generate(*engine_, prompt, n, s).tokens;
  }
  // The data events of a server-sent-event body, [DONE] as a string.
  static std::vector<json> events(const std::string& body, bool* done) {
    std::vector<json> out;
    *done = false;
    size_t pos = 0;
    while (pos < body.size()) {
      const size_t end = body.find("\n\n", pos);
      const std::string ev = body.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
      pos = end == std::string::npos ? body.size() : end + 2;
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string data = ev.substr(6);
      if (data == "[DONE]") *done = true;
      else out.push_back(json::parse(data));
    }
    return out;
  }

  static inline k3test::TempDir* dir_ = nullptr;
  static inline std::string* tok_dir_ = nullptr;
  static inline Running* running_ = nullptr;
  static inline k3::Tokenizer* tok_ = nullptr;
  static inline k3::Engine* engine_ = nullptr;
};

// The body render_chat sees for a chat request that names no thinking fields: thinking on, at K3's default
// effort (max), as the Kimi Vendor Verifier expects of an omitted effort.
json as_rendered(json body) {
  body["thinking"] = true;
  body["thinking_effort"] = "max";
  return body;
}

const json kChat = {{"model", "k3-tiny"},
                    {"messages", json::array({json{{"role", "user"}, {"content", "Name three colours."}}})},
                    {"temperature", 0},
                    {"max_tokens", 12}};

TEST_F(Serve, HealthAndModels) {
  httplib::Client c = running_->client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(json::parse(h->body)["status"], "ok");
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  const json j = json::parse(m->body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "k3-tiny");
}

// The chat reply is the engine's own greedy continuation of the rendered prompt, cut where the
// assistant message ends, parsed into channels; usage counts both sides exactly.
TEST_F(Serve, ChatIsTheEnginesGreedyContinuation) {
  auto r = post("/v1/chat/completions", kChat);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "k3-tiny");

  const std::vector<int32_t> prompt = k3::encode_segments(*tok_, k3::render_chat(as_rendered(kChat)));
  std::vector<int32_t> want = greedy(prompt, 12);
  // the server stops once the message is complete; find that point in the engine's tokens
  for (size_t n = 1; n <= want.size(); ++n) {
    const std::vector<int32_t> head(want.begin(), want.begin() + long(n));
    if (k3::parse_assistant(k3::xtml_pieces_from_ids(*tok_, head), k3::XtmlStart::kThink).complete) {
      want.resize(n);
      break;
    }
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], int64_t(prompt.size()));
  EXPECT_EQ(j["usage"]["completion_tokens"], int64_t(want.size()));
  EXPECT_EQ(j["usage"]["total_tokens"], int64_t(prompt.size() + want.size()));
  const k3::XtmlAssistantMessage msg =
      k3::parse_assistant(k3::xtml_pieces_from_ids(*tok_, want), k3::XtmlStart::kThink);
  const json& m = j["choices"][0]["message"];
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m.value("reasoning_content", std::string()), msg.think);
  EXPECT_EQ(m["content"].is_null() ? std::string() : m["content"].get<std::string>(), msg.response);
  const std::string fr = j["choices"][0]["finish_reason"];
  EXPECT_EQ(fr, msg.complete ? (msg.tool_calls.empty() ? "stop" : "tool_calls") : "length");
}

TEST_F(Serve, StreamedChatEqualsThePlainOne) {
  auto plain = post("/v1/chat/completions", kChat);
  ASSERT_TRUE(plain);
  ASSERT_EQ(plain->status, 200);
  const json p = json::parse(plain->body);
  json body = kChat;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto s = post("/v1/chat/completions", body);
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200);
  EXPECT_NE(s->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  bool done = false;
  const std::vector<json> ev = events(s->body, &done);
  EXPECT_TRUE(done) << "the stream must end with data: [DONE]";
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  std::string reasoning, content, finish;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    EXPECT_EQ(ev[i]["object"], "chat.completion.chunk");
    EXPECT_EQ(ev[i]["id"], ev[0]["id"]);
    const json& ch = ev[i]["choices"][0];
    reasoning += ch["delta"].value("reasoning_content", std::string());
    content += ch["delta"].value("content", std::string());
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  const json& m = p["choices"][0]["message"];
  EXPECT_EQ(reasoning, m.value("reasoning_content", std::string()));
  EXPECT_EQ(content, m["content"].is_null() ? std::string() : m["content"].get<std::string>());
  EXPECT_EQ(finish, p["choices"][0]["finish_reason"]);
  const json& last = ev.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"], p["usage"]);
}

json completion_body(int64_t max_tokens) {
  return json{{"prompt", "the cat sat on the mat and"}, {"temperature", 0}, {"max_tokens", max_tokens}};
}

TEST_F(Serve, CompletionIsTheEnginesGreedyContinuation) {
  auto r = post("/v1/completions", completion_body(10));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  const std::vector<int32_t> prompt = tok_->encode("the cat sat on the mat and", false);
  std::vector<int32_t> want = greedy(prompt, 10);
  EXPECT_EQ(j["usage"]["prompt_tokens"], int64_t(prompt.size()));
  EXPECT_EQ(j["usage"]["completion_tokens"], int64_t(want.size()));
  const bool eos = !want.empty() && want.back() == engine_->config().eos_token_id;
  if (eos) want.pop_back();
  EXPECT_EQ(j["choices"][0]["text"], tok_->decode(want));
  EXPECT_EQ(j["choices"][0]["finish_reason"], eos ? "stop" : "length");
}

// A stop string taken from the middle of the greedy text cuts it there, plain and streamed.
TEST_F(Serve, StopStringsCutTheText) {
  auto full = post("/v1/completions", completion_body(16));
  ASSERT_TRUE(full);
  ASSERT_EQ(full->status, 200);
  const std::string text = json::parse(full->body)["choices"][0]["text"];
  ASSERT_GE(text.size(), 6u) << "the fixture's greedy text is too short for this test: '" << text << "'";
  const std::string stop = text.substr(text.size() / 2, 2);
  const size_t cut = text.find(stop);
  json body = completion_body(16);
  body["stop"] = json::array({"\x01never", stop});
  auto r = post("/v1/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["text"], text.substr(0, cut));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");

  body["stream"] = true;
  auto s = post("/v1/completions", body);
  ASSERT_TRUE(s);
  bool done = false;
  std::string streamed, finish;
  for (const json& e : events(s->body, &done)) {
    streamed += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(streamed, text.substr(0, cut));
  EXPECT_EQ(finish, "stop");
}

// A token's text as a JSON string shows it: bytes that are not UTF-8 replaced (its `bytes` carry them).
std::string shown(const std::string& text) {
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

// The expected log-probabilities of a greedy run after `prompt`: per step, the chosen (argmax) id's
// log_softmax and the n most probable ids', from the engine's own session.
struct StepTruth {
  int32_t id;
  double logprob;
  std::vector<std::pair<int32_t, double>> top;
};
std::vector<StepTruth> greedy_truth(k3::Engine& engine, const std::vector<int32_t>& prompt, size_t steps, int n) {
  const k3::AppendFn session = engine.session();
  std::vector<float> logits = session(prompt);
  std::vector<StepTruth> out;
  for (size_t i = 0; i < steps; ++i) {
    const int64_t V = int64_t(logits.size());
    double mx = -INFINITY, sum = 0.0;
    for (float x : logits) mx = std::max(mx, double(x));
    for (float x : logits) sum += std::exp(double(x) - mx);
    const double lse = mx + std::log(sum);
    StepTruth t;
    t.id = k3::argmax(logits.data(), V);
    t.logprob = double(logits[size_t(t.id)]) - lse;
    std::vector<int32_t> ids(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) ids[size_t(v)] = int32_t(v);
    std::stable_sort(ids.begin(), ids.end(),
                     [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)]; });
    for (int k = 0; k < n; ++k) t.top.emplace_back(ids[size_t(k)], double(logits[size_t(ids[size_t(k)])]) - lse);
    out.push_back(t);
    logits = session({t.id});
  }
  return out;
}

TEST_F(Serve, ChatLogprobsAreTheModelsLogSoftmax) {
  json body = kChat;
  body["logprobs"] = true;
  body["top_logprobs"] = 3;
  auto r = post("/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const json& lp = j["choices"][0]["logprobs"]["content"];
  ASSERT_TRUE(lp.is_array()) << r->body;
  ASSERT_EQ(int64_t(lp.size()), j["usage"]["completion_tokens"].get<int64_t>());
  const std::vector<int32_t> prompt = k3::encode_segments(*tok_, k3::render_chat(as_rendered(kChat)));
  const std::vector<StepTruth> truth = greedy_truth(*engine_, prompt, lp.size(), 3);
  for (size_t i = 0; i < lp.size(); ++i) {
    const json& e = lp[i];
    const std::string text = tok_->decode({truth[i].id});
    EXPECT_EQ(e["token"], shown(text)) << "token " << i;
    std::vector<int> bytes;
    for (unsigned char c : text) bytes.push_back(int(c));
    EXPECT_EQ(e["bytes"], json(bytes));
    EXPECT_NEAR(e["logprob"].get<double>(), truth[i].logprob, 1e-5) << "token " << i;
    ASSERT_EQ(e["top_logprobs"].size(), 3u);
    for (int k = 0; k < 3; ++k) {
      const std::string alt = tok_->decode({truth[i].top[size_t(k)].first});
      EXPECT_EQ(e["top_logprobs"][k]["token"], shown(alt)) << i << "/" << k;
      std::vector<int> alt_bytes;
      for (unsigned char c : alt) alt_bytes.push_back(int(c));
      EXPECT_EQ(e["top_logprobs"][k]["bytes"], json(alt_bytes));
      EXPECT_NEAR(e["top_logprobs"][k]["logprob"].get<double>(), truth[i].top[size_t(k)].second, 1e-5);
    }
  }

  // Streamed: the chunks' entries, in order, are the plain response's.
  body["stream"] = true;
  auto s = post("/v1/chat/completions", body);
  ASSERT_TRUE(s);
  bool done = false;
  json streamed = json::array();
  for (const json& ev : events(s->body, &done)) {
    if (ev["choices"].empty() || ev["choices"][0]["logprobs"].is_null()) continue;
    for (const json& e : ev["choices"][0]["logprobs"]["content"]) streamed.push_back(e);
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(streamed, lp);
}

TEST_F(Serve, CompletionLogprobsAreTheModelsLogSoftmax) {
  json body = completion_body(8);
  body["logprobs"] = 2;
  auto r = post("/v1/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const json& lp = j["choices"][0]["logprobs"];
  const size_t n = lp["tokens"].size();
  ASSERT_EQ(int64_t(n), j["usage"]["completion_tokens"].get<int64_t>());
  ASSERT_EQ(lp["token_logprobs"].size(), n);
  ASSERT_EQ(lp["top_logprobs"].size(), n);
  ASSERT_EQ(lp["text_offset"].size(), n);
  const std::vector<StepTruth> truth = greedy_truth(*engine_, tok_->encode("the cat sat on the mat and", false), n, 2);
  std::string joined;  // the tokens' bytes, which text_offset counts
  std::vector<int32_t> ids;
  for (size_t i = 0; i < n; ++i) {
    const std::string text = tok_->decode({truth[i].id});
    EXPECT_EQ(lp["tokens"][i], shown(text));
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), truth[i].logprob, 1e-5);
    EXPECT_EQ(lp["text_offset"][i].get<int64_t>(), int64_t(joined.size()));
    joined += text;
    ids.push_back(truth[i].id);
    const json& top = lp["top_logprobs"][i];
    for (const auto& [id, want] : truth[i].top) {
      const std::string alt = shown(tok_->decode({id}));
      ASSERT_TRUE(top.contains(alt)) << top.dump();
      EXPECT_NEAR(top[alt].get<double>(), want, 1e-5);
    }
  }
  if (j["choices"][0]["finish_reason"] == "length") {
    EXPECT_EQ(j["choices"][0]["text"], shown(tok_->decode(ids)));
  }

  body["stream"] = true;
  auto s = post("/v1/completions", body);
  ASSERT_TRUE(s);
  bool done = false;
  json tokens = json::array(), offsets = json::array();
  for (const json& ev : events(s->body, &done)) {
    if (ev["choices"].empty() || ev["choices"][0]["logprobs"].is_null()) continue;
    for (const json& t : ev["choices"][0]["logprobs"]["tokens"]) tokens.push_back(t);
    for (const json& o : ev["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(o);
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(tokens, lp["tokens"]);
  EXPECT_EQ(offsets, lp["text_offset"]);
}

// Constrained decoding on random weights: the reply is what the schema allows, whatever the model.
const json kSchema = {{"type", "object"},
                      {"properties",
                       {{"ok", {{"type", "boolean"}}},
                        {"level", {{"enum", {"low", "high"}}}},
                        {"n", {{"type", "integer"}}},
                        {"tag", {{"type", "string"}, {"maxLength", 3}}}}},
                      {"required", {"ok", "level", "n"}},
                      {"additionalProperties", false}};

void expect_schema_document(const std::string& content) {
  const json v = json::parse(content, nullptr, false);
  ASSERT_TRUE(v.is_object()) << "not a JSON object: '" << content << "'";
  ASSERT_TRUE(v.contains("ok") && v["ok"].is_boolean()) << content;
  ASSERT_TRUE(v.contains("level") && (v["level"] == "low" || v["level"] == "high")) << content;
  ASSERT_TRUE(v.contains("n") && v["n"].is_number_integer()) << content;
  for (const auto& [k, x] : v.items()) EXPECT_TRUE(k == "ok" || k == "level" || k == "n" || k == "tag") << content;
  if (v.contains("tag")) {
    ASSERT_TRUE(v["tag"].is_string()) << content;
    EXPECT_LE(v["tag"].get<std::string>().size(), 3u * 4) << content;  // 3 characters of at most 4 bytes
  }
}

TEST_F(Serve, JsonSchemaRepliesFollowTheSchema) {
  for (const double temperature : {0.0, 1.0, 1.5}) {
    for (const int seed : {1, 2, 3}) {
      json body = kChat;
      body["thinking"] = false;
      body["temperature"] = temperature;
      body["seed"] = seed;
      body["max_tokens"] = 400;
      body["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "r"}, {"schema", kSchema}}}};
      auto r = post("/v1/chat/completions", body);
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
      const json j = json::parse(r->body);
      SCOPED_TRACE("temperature " + std::to_string(temperature) + ", seed " + std::to_string(seed));
      EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");  // the schema's documents are short
      expect_schema_document(j["choices"][0]["message"]["content"].get<std::string>());
      EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
      if (temperature == 1.5 && seed == 3) {  // streamed: the same reply
        body["stream"] = true;
        auto s = post("/v1/chat/completions", body);
        ASSERT_TRUE(s);
        bool done = false;
        std::string content;
        for (const json& ev : events(s->body, &done))
          if (!ev["choices"].empty()) content += ev["choices"][0]["delta"].value("content", std::string());
        EXPECT_TRUE(done);
        EXPECT_EQ(content, j["choices"][0]["message"]["content"]);
      }
    }
  }
}

TEST_F(Serve, JsonObjectRepliesAreObjects) {
  const sv::JsonSchema any_object = sv::JsonSchema::any_object();
  for (const int seed : {1, 2, 3, 4}) {
    json body = kChat;
    body["thinking"] = seed % 2 == 0;  // the think channel stays free
    body["temperature"] = 1.0;
    body["seed"] = seed;
    body["max_tokens"] = 200;
    body["response_format"] = {{"type", "json_object"}};
    auto r = post("/v1/chat/completions", body);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    const json& m = j["choices"][0]["message"];
    const std::string content = m["content"].is_null() ? std::string() : m["content"].get<std::string>();
    sv::JsonMatcher matcher(any_object);
    for (unsigned char c : content) ASSERT_TRUE(matcher.feed(c)) << "not a prefix of an object: '" << content << "'";
    if (j["choices"][0]["finish_reason"] == "stop") {
      EXPECT_TRUE(matcher.complete()) << content;
      EXPECT_TRUE(json::parse(content, nullptr, false).is_object()) << content;
    } else {
      EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
    }
  }
}

TEST_F(Serve, ToolChoiceNoneNeverCallsATool) {
  for (const int seed : {1, 2, 3}) {
    json body = kChat;
    body["temperature"] = 1.0;
    body["seed"] = seed;
    body["max_tokens"] = 64;
    body["tools"] =
        json::array({json{{"type", "function"},
                          {"function",
                           {{"name", "get_weather"},
                            {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
    body["tool_choice"] = "none";
    auto r = post("/v1/chat/completions", body);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << r->body;
    EXPECT_NE(j["choices"][0]["finish_reason"], "tool_calls");
  }
}

// Forced calls on random weights: one call to a declared tool, its arguments what its schema allows.
const json kTools =
    json::array({json{{"type", "function"},
                      {"function",
                       {{"name", "get_weather"},
                        {"parameters",
                         {{"type", "object"},
                          {"properties", {{"city", {{"enum", {"Paris", "Oslo"}}}}, {"days", {{"type", "integer"}}}}},
                          {"required", {"city"}},
                          {"additionalProperties", false}}}}}},
                 json{{"type", "function"},
                      {"function",
                       {{"name", "get_time"},
                        {"parameters",
                         {{"type", "object"},
                          {"properties", {{"zone", {{"type", "string"}, {"maxLength", 4}}}}},
                          {"required", {"zone"}},
                          {"additionalProperties", false}}}}}}});

void expect_valid_call(const json& call, const std::string& only_name = "") {
  ASSERT_EQ(call["type"], "function");
  const std::string name = call["function"]["name"];
  if (!only_name.empty()) {
    EXPECT_EQ(name, only_name);
  }
  const json args = json::parse(call["function"]["arguments"].get<std::string>(), nullptr, false);
  ASSERT_TRUE(args.is_object()) << call.dump();
  if (name == "get_weather") {
    ASSERT_TRUE(args.contains("city") && (args["city"] == "Paris" || args["city"] == "Oslo")) << args.dump();
    if (args.contains("days")) {
      EXPECT_TRUE(args["days"].is_number_integer()) << args.dump();
    }
    for (const auto& [k, v] : args.items()) EXPECT_TRUE(k == "city" || k == "days") << args.dump();
  } else {
    ASSERT_EQ(name, "get_time");
    ASSERT_TRUE(args.contains("zone") && args["zone"].is_string()) << args.dump();
    EXPECT_EQ(args.size(), 1u) << args.dump();
  }
}

TEST_F(Serve, ForcedToolCallsFollowTheToolsSchemas) {
  for (const json& choice : {json("required"), json{{"type", "function"}, {"function", {{"name", "get_time"}}}}}) {
    for (const int seed : {1, 2, 3}) {
      json body = kChat;
      body["thinking"] = false;
      body["temperature"] = 1.0;
      body["seed"] = seed;
      body["max_tokens"] = 300;
      body["tools"] = kTools;
      body["tool_choice"] = choice;
      auto r = post("/v1/chat/completions", body);
      ASSERT_TRUE(r);
      ASSERT_EQ(r->status, 200) << r->body;
      const json j = json::parse(r->body);
      SCOPED_TRACE(choice.dump() + ", seed " + std::to_string(seed));
      EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
      const json& m = j["choices"][0]["message"];
      ASSERT_TRUE(m.contains("tool_calls")) << r->body;
      ASSERT_EQ(m["tool_calls"].size(), 1u);
      expect_valid_call(m["tool_calls"][0], choice.is_object() ? "get_time" : "");
      if (seed == 1) {  // streamed: the same call
        body["stream"] = true;
        auto s = post("/v1/chat/completions", body);
        ASSERT_TRUE(s);
        bool done = false;
        json calls;
        for (const json& ev : events(s->body, &done))
          if (!ev["choices"].empty() && ev["choices"][0]["delta"].contains("tool_calls"))
            calls = ev["choices"][0]["delta"]["tool_calls"];
        EXPECT_TRUE(done);
        ASSERT_EQ(calls.size(), 1u);
        EXPECT_EQ(calls[0]["function"], m["tool_calls"][0]["function"]);
      }
    }
  }
}

// The official OpenAI client (npm openai, with ajv for the JSON) drives the server as a black box:
// tests/tools/serve_openai_client.mjs's checks must all hold. Skips where node or the packages
// (scripts/setup.sh puts them in .deps/npm) are missing.
TEST_F(Serve, OfficialOpenAiClientDrivesTheServer) {
  const std::string src = K3_SOURCE_DIR;
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no node";
  for (const char* pkg : {"openai", "ajv"})
    if (!std::filesystem::exists(src + "/.deps/npm/node_modules/" + pkg + "/package.json"))
      GTEST_SKIP() << "npm package " << pkg << " is not in .deps/npm (scripts/setup.sh installs it)";
  const std::string cmd = "node " + src +
                          "/tests/tools/serve_openai_client.mjs http://127.0.0.1:" + std::to_string(running_->port) +
                          "/v1 k3-tiny 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = pclose(p);
  std::printf("%s", out.c_str());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("FAIL"), std::string::npos);
  EXPECT_NE(out.find("ok   errors: an unsupported schema keyword is a 400"), std::string::npos)
      << "not every check ran";
}

// Hostile input never takes the server down: a body past its limit (413), bytes that are not UTF-8
// (400), 10,000 messages (400: past --max-prompt-tokens, before any prefill), a streaming client
// that hangs up after the first chunk (a clean close). After each, /health answers and a normal request is served.
TEST_F(Serve, BadInputLeavesTheServerUp) {
  auto healthy = [&] {
    auto h = running_->client().Get("/health");
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 200);
    auto r = post("/v1/completions", completion_body(2));
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  };
  const std::string huge(size_t(17) << 20, ' ');
  auto big = running_->client().Post("/v1/chat/completions", huge, "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_TRUE(json::parse(big->body, nullptr, false).contains("error")) << big->body;
  healthy();

  std::string bad = kChat.dump();
  bad.replace(bad.find("Name"), 4, "\xff\xfe\xc3(");
  auto utf = running_->client().Post("/v1/chat/completions", bad, "application/json");
  ASSERT_TRUE(utf);
  EXPECT_EQ(utf->status, 400) << utf->body;
  healthy();

  json many = kChat;
  many["messages"] = json::array();
  for (int i = 0; i < 10000; ++i) many["messages"].push_back(json{{"role", "user"}, {"content", "hello there"}});
  auto m = post("/v1/chat/completions", many);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 400) << m->body.substr(0, 300);
  healthy();

  httplib::Client c = running_->client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.set_header("Content-Type", "application/json");
  json body = kChat;
  body["max_tokens"] = 200;
  body["stream"] = true;
  req.body = body.dump();
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 2; };  // hang up
  c.send(req);
  EXPECT_GE(chunks, 1);
  healthy();
}

// Status, error type and the field named, for each kind of bad request.
TEST_F(Serve, BadRequestsGetOpenAiErrors) {
  struct Case {
    const char* path;
    std::string body;
    int status;
    const char* param;
  };
  auto chat_with = [](const char* key, const json& v) {
    json b = kChat;
    b[key] = v;
    return b.dump();
  };
  const std::vector<Case> cases = {
      {"/v1/chat/completions", "{not json", 400, ""},
      {"/v1/chat/completions", "[1, 2]", 400, ""},
      {"/v1/chat/completions", json{{"max_tokens", 4}}.dump(), 400, "messages"},
      {"/v1/chat/completions", chat_with("temperature", 3), 400, "temperature"},
      {"/v1/chat/completions", chat_with("temperature", "hot"), 400, "temperature"},
      {"/v1/chat/completions", chat_with("top_p", 0), 400, "top_p"},
      {"/v1/chat/completions", chat_with("max_tokens", 0), 400, "max_tokens"},
      {"/v1/chat/completions", chat_with("max_tokens", 2000000), 400, "max_tokens"},
      {"/v1/chat/completions", chat_with("n", 2), 400, "n"},
      {"/v1/chat/completions", chat_with("stop", json::array({"a", "b", "c", "d", "e"})), 400, "stop"},
      {"/v1/chat/completions", chat_with("logprobs", 1), 400, "logprobs"},
      {"/v1/chat/completions", chat_with("top_logprobs", 2), 400, "top_logprobs"},  // without logprobs: true
      {"/v1/chat/completions",
       [] {
         json b = kChat;
         b["logprobs"] = true;
         b["top_logprobs"] = 21;
         return b.dump();
       }(),
       400, "top_logprobs"},
      {"/v1/completions", json{{"prompt", "a"}, {"logprobs", 6}}.dump(), 400, "logprobs"},
      {"/v1/completions", json{{"prompt", "a"}, {"logprobs", true}}.dump(), 400, "logprobs"},
      {"/v1/chat/completions", chat_with("response_format", json{{"type", "yaml"}}), 400, "response_format.type"},
      {"/v1/chat/completions",
       chat_with("response_format",
                 json{{"type", "json_schema"}, {"json_schema", {{"schema", {{"type", "string"}, {"pattern", "^a"}}}}}}),
       400, "response_format.json_schema.schema"},
      {"/v1/chat/completions", chat_with("tool_choice", "required"), 400, "tool_choice"},  // no tools
      {"/v1/chat/completions", chat_with("tool_choice", "sometimes"), 400, "tool_choice"},
      {"/v1/chat/completions",
       [] {
         json b = kChat;
         b["tools"] = kTools;
         b["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_stock"}}}};
         return b.dump();
       }(),
       400, "tool_choice"},
      {"/v1/chat/completions",
       [] {
         json b = kChat;
         b["tools"] = json::array(
             {json{{"type", "function"},
                   {"function", {{"name", "f"}, {"parameters", {{"type", "object"}, {"minProperties", 1}}}}}}});
         b["tool_choice"] = "required";
         return b.dump();
       }(),
       400, "tools[0].function.parameters"},
      {"/v1/chat/completions", chat_with("stream_options", json{{"include_usage", true}}), 400, "stream_options"},
      {"/v1/chat/completions", chat_with("messages", json::array({json{{"role", "wizard"}, {"content", "x"}}})), 400,
       "messages"},
      {"/v1/chat/completions", chat_with("model", "gpt-9"), 404, "model"},
      {"/v1/completions", json{{"max_tokens", 4}}.dump(), 400, "prompt"},
      {"/v1/completions", json{{"prompt", json::array({1, 5000})}}.dump(), 400, "prompt"},
      {"/v1/completions", json{{"prompt", ""}}.dump(), 400, "prompt"},
  };
  for (const Case& c : cases) {
    auto r = running_->client().Post(c.path, c.body, "application/json");
    ASSERT_TRUE(r) << c.body;
    EXPECT_EQ(r->status, c.status) << c.body << " -> " << r->body;
    const json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r->body;
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty());
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    if (*c.param) {
      EXPECT_EQ(j["error"]["param"], c.param) << c.body;
    }
  }
  auto r = running_->client().Get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_TRUE(json::parse(r->body).contains("error"));
}

TEST_F(Serve, MetricsCountWhatWasServed) {
  ASSERT_TRUE(post("/v1/completions", completion_body(3)));
  auto m = running_->client().Get("/metrics");
  ASSERT_TRUE(m);
  ASSERT_EQ(m->status, 200);
  for (const char* name : {"k3_requests_succeeded_total", "k3_generation_tokens_total", "k3_prompt_tokens_total",
                           "k3_time_to_first_token_seconds_count", "k3_requests_waiting"})
    EXPECT_NE(m->body.find(std::string("\n") + name + " "), std::string::npos) << name << " missing:\n" << m->body;
  const size_t at = m->body.find("\nk3_generation_tokens_total ");
  EXPECT_GT(std::stod(m->body.substr(at + 28)), 0.0);
}

TEST(ServeAuth, ApiKeyIsRequiredButNotForHealth) {
  k3test::TempDir dir("serve_auth");
  sv::ServeOptions o;
  o.api_key = "sekrit";
  Running srv(write_tokenizer(dir), o);
  httplib::Client c = srv.client();
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto no = c.Get("/v1/models");
  ASSERT_TRUE(no);
  EXPECT_EQ(no->status, 401);
  EXPECT_EQ(json::parse(no->body)["error"]["code"], "invalid_api_key");
  auto wrong = c.Get("/v1/models", {{"Authorization", "Bearer nope"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto yes = c.Get("/v1/models", {{"Authorization", "Bearer sekrit"}});
  ASSERT_TRUE(yes);
  EXPECT_EQ(yes->status, 200);
}

// With one slot and no queue, a request that arrives while another streams is refused with 429; the
// streaming one completes. (The second request is sent from the first one's receiver, on its first chunk.)
// --request-timeout 0.3 s on a scripted engine whose every forward takes 1 s, one request at a time
// (--max-batch 1): the first request's prefill ends past its deadline, so it stops at its first token
// (finish_reason "length"); a second request, arriving 50 ms later, is still waiting for a slot at its
// own deadline and gets a 503; /metrics counts both.
TEST(ServeTimeout, RequestsStopAtTheirDeadline) {
  k3test::TempDir dir("serve-timeout");
  const std::string tok_dir = write_tokenizer(dir);
  const k3::K3Config cfg = k3::Engine::load(k3test::fixture("k3-tiny-a"), k3::EngineOptions{})->config();
  const k3::Tokenizer tok = k3::Tokenizer::load_dir(tok_dir);
  const int32_t a = tok.encode("a", false).at(0);
  sv::ServeOptions o;
  o.model_id = "scripted";
  o.request_timeout_seconds = 0.3;
  o.max_batch = 1;
  Running running(std::make_unique<k3test::ScriptedEngine>(cfg, std::vector<int32_t>(2000, a),
                                                           std::chrono::milliseconds(1000)),
                  tok_dir, o);
  const json body = {{"prompt", "x"}, {"max_tokens", 1000}, {"temperature", 0}};
  int second_status = 0;
  std::string second_body;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (auto r = running.client().Post("/v1/completions", body.dump(), "application/json"))
      second_status = r->status, second_body = r->body;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto first = running.client().Post("/v1/completions", body.dump(), "application/json");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  later.join();
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 200) << first->body;
  const json j = json::parse(first->body);
  const int64_t n = j["usage"]["completion_tokens"];
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(n, 1) << "the deadline passed during the prefill";
  EXPECT_EQ(j["choices"][0]["text"], std::string(size_t(n), 'a'));
  EXPECT_LT(took, 5.0);
  EXPECT_EQ(second_status, 503) << second_body;
  const json err = json::parse(second_body, nullptr, false);
  ASSERT_TRUE(err.is_object() && err.contains("error")) << second_body;
  EXPECT_EQ(err["error"]["type"], "server_error") << second_body;
  auto m = running.client().Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("k3_requests_timed_out_total 2"), std::string::npos) << m->body;
}

TEST(ServeQueue, FullQueueGets429) {
  k3test::TempDir dir("serve_queue");
  sv::ServeOptions o;
  o.model_id = "k3-tiny";
  o.max_queue = 0;
  o.max_batch = 1;
  Running srv(write_tokenizer(dir), o);
  httplib::Client c = srv.client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";  // its first chunk (the role) is sent before any token is made
  req.set_header("Content-Type", "application/json");
  json body = kChat;
  body["max_tokens"] = 40;
  body["stream"] = true;
  req.body = body.dump();
  std::atomic<int> second_status{0};
  std::string streamed;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    streamed.append(data, n);
    if (second_status == 0) {
      auto r =
          srv.client().Post("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 2}}.dump(), "application/json");
      second_status = r ? r->status : -1;
    }
    return true;
  };
  auto r = c.send(req);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(second_status.load(), 429);
  EXPECT_NE(streamed.find("data: [DONE]"), std::string::npos);
}

TEST(ServeApi, TextHelpers) {
  EXPECT_EQ(sv::utf8_complete_prefix("abc"), 3u);
  EXPECT_EQ(sv::utf8_complete_prefix("a\xC3\xA9"), 3u);  // é whole
  EXPECT_EQ(sv::utf8_complete_prefix("a\xC3"), 1u);      // é cut after its lead byte
  EXPECT_EQ(sv::utf8_complete_prefix("a\xE2\x82"), 1u);  // € cut after two of three bytes
  EXPECT_EQ(sv::utf8_complete_prefix("a\xF0\x9F\x98\x80"), 5u);
  EXPECT_EQ(sv::find_stop("hello world", {"xyz", "o w", "wor"}), 4u);
  EXPECT_EQ(sv::find_stop("hello", {"xyz"}), std::string::npos);
  EXPECT_EQ(sv::stop_holdback("hello wo", {"world"}), 2u);
  EXPECT_EQ(sv::stop_holdback("hello w", {"world", "lo w!"}), 4u);
  EXPECT_EQ(sv::stop_holdback("hello", {"xyz"}), 0u);
  EXPECT_EQ(sv::dump(json{{"t", std::string("a\xFF")}}), "{\"t\":\"a\xEF\xBF\xBD\"}");
}

}  // namespace

// token_logprob on a hand-made distribution: exact log-probabilities, ties toward the lower id, a
// masked (-inf) logit at -inf, a bad id refused.
TEST(ServeApi, TokenLogprob) {
  const float logits[5] = {0.0f, std::log(3.0f), std::log(3.0f), -INFINITY, std::log(2.0f)};  // 1 : 3 : 3 : 0 : 2
  const sv::TokenLogprob t = sv::token_logprob(logits, 5, 4, 3);
  EXPECT_NEAR(t.logprob, std::log(2.0 / 9.0), 1e-6);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_EQ(t.top[1].first, 2);
  EXPECT_EQ(t.top[2].first, 4);
  EXPECT_NEAR(t.top[0].second, std::log(3.0 / 9.0), 1e-6);
  const sv::TokenLogprob masked = sv::token_logprob(logits, 5, 3, 0);
  EXPECT_TRUE(std::isinf(masked.logprob) && masked.logprob < 0);
  EXPECT_TRUE(masked.top.empty());
  EXPECT_THROW(sv::token_logprob(logits, 5, 5, 0), k3::Error);
}

// The JSON automaton against nlohmann's parser: on random strings over JSON's characters, a string
// is accepted whole exactly when it is a JSON document, and every prefix of a document is accepted.
TEST(ServeJson, AnyValueAgreesWithAParser) {
  const sv::JsonSchema any = sv::JsonSchema::compile(nlohmann::json::object());
  const std::string alphabet = "{}[]\":,-.01eE9trunlfas \\u\xc3\xa9";
  std::mt19937 rng(7);
  int documents = 0;
  for (int trial = 0; trial < 60000; ++trial) {
    std::string t;
    const size_t len = 1 + rng() % 10;
    for (size_t i = 0; i < len; ++i) t.push_back(alphabet[rng() % alphabet.size()]);
    if (trial % 3 == 0)
      t = json::parse("[1, {\"a\": [true, null, \"x\\u00e9\"]}, -0.5e3]").dump().substr(0, len + 5) + t;
    sv::JsonMatcher m(any);
    size_t fed = 0;
    while (fed < t.size() && m.feed(uint8_t(t[fed]))) ++fed;
    const bool accepted = fed == t.size() && m.complete();
    const bool parses = json::accept(t);
    documents += parses;
    ASSERT_EQ(accepted, parses) << "'" << t << "' (stopped at byte " << fed << ")";
  }
  EXPECT_GT(documents, 100);
}

TEST(ServeJson, SchemaIsEnforcedByteByByte) {
  const sv::JsonSchema s = sv::JsonSchema::compile(
      nlohmann::json::parse(R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["name", "age"], "additionalProperties": false})"));
  // (text, bytes accepted before the first refusal; npos: all, and the document is complete)
  const std::vector<std::pair<std::string, size_t>> cases = {
      {R"({"name":"Bob","age":42})", std::string::npos},
      {R"({ "age": -7, "tags": ["a", "b"], "name": "x\u00e9" })", std::string::npos},
      {R"({"name":"Bob"})", 13},          // "age" is required
      {R"({"nam":1})", 5},                // not a property
      {R"({"name":"toolong"})", 14},      // maxLength 5
      {R"({"name":"a","age":1.5})", 19},  // an integer
      {R"({"tags":["c"]})", 10},          // not in the enum
      {R"({"tags":["a","a","a"]})", 16},  // maxItems 2
      {R"({"age":1,"age":2})", 10},       // given twice: no key left starts with a
      {"{" + std::string(17, ' '), 17},   // at most 16 whitespace bytes
  };
  for (const auto& [text, stop] : cases) {
    sv::JsonMatcher m(s);
    size_t fed = 0;
    while (fed < text.size() && m.feed(uint8_t(text[fed]))) ++fed;
    if (stop == std::string::npos) {
      EXPECT_EQ(fed, text.size()) << text;
      EXPECT_TRUE(m.complete()) << text;
    } else {
      EXPECT_EQ(fed, stop) << text;
    }
  }
}

TEST(ServeJson, UnsupportedSchemasAreRefused) {
  for (const char* bad :
       {R"({"type": "string", "pattern": "^a"})", R"({"anyOf": [{"type": "string"}, {"enum": ["x"]}]})",
        R"({"required": ["x"], "additionalProperties": false})", R"({"type": "date"})", R"({"$ref": "#/defs/a"})",
        R"(false)"}) {
    EXPECT_THROW(sv::JsonSchema::compile(nlohmann::json::parse(bad)), sv::SchemaError) << bad;
  }
  EXPECT_NO_THROW(sv::JsonSchema::compile(nlohmann::json::parse(
      R"({"title": "t", "anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]})")));
}

#else

TEST(Serve, NeedsTheHttpServer) { GTEST_SKIP() << "this build has no HTTP server (libcpp-httplib-dev)"; }

#endif
