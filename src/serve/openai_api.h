// The OpenAI-compatible shapes `k3 serve` speaks: request bodies parsed and validated (every bad
// field a 400 that names it, in OpenAI's error body), and the JSON of responses and stream chunks.
// No HTTP here (serve/server.h has that), so every rule is testable on strings.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "model/sampler.h"
#include "serve/turn_constraint.h"

namespace k3::serve {

// An error for the client: the HTTP status and OpenAI's body
// {"error": {"message", "type", "param", "code"}} (param and code null when empty).
struct ApiError : std::runtime_error {
  int status;
  std::string type, param, code;
  ApiError(int status, std::string type, std::string param, const std::string& message, std::string code = "");
  nlohmann::ordered_json body() const;
};
// 400, invalid_request_error, naming the field.
ApiError bad_request(const std::string& param, const std::string& message);

// What a request asks of the generation loop, whatever the endpoint.
struct GenerationRequest {
  int64_t max_tokens = 0;         // resolved: the request's, else the server's default
  bool max_tokens_given = false;  // the request named it (then it must fit the context)
  SamplingParams sampling;        // greedy when temperature is 0
  std::vector<std::string> stop;  // at most 4 non-empty strings
  bool stream = false, include_usage = false;
  // -1: no log-probabilities; else each generated token's, with this many alternatives (chat:
  // `logprobs: true` and `top_logprobs` 0..20; completions: `logprobs` 0..5).
  int top_logprobs = -1;
  // Set by the server (--request-timeout, from the request's arrival): generation stops at the first
  // token past it.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  int64_t max_prompt_tokens = 0;  // set by the server (--max-prompt-tokens); 0: the model's context
};

// /v1/chat/completions: the body as render_chat (tokenizer/xtml_chat.h) reads it, and whether the
// generation prompt opens the think channel.
//
// Thinking comes in three spellings, all read into `thinking` (bool) and `thinking_effort` (low / high / max)
// of the body render_chat sees: Moonshot's API `thinking: {"type": "enabled" | "disabled", "keep": bool,
// "effort": ...}` (or a plain boolean), OpenAI's `reasoning_effort`, and the open-source chat template's
// `chat_template_kwargs: {thinking, preserve_thinking, thinking_effort}`. Thinking is on unless one of them
// turns it off; the effort defaults to max (K3's default) when thinking; spellings that disagree are a 400.
// With keep / preserve_thinking false, earlier assistant turns lose their reasoning_content.
struct ChatRequest {
  nlohmann::ordered_json body;
  GenerationRequest gen;
  bool thinking = true;
  std::string effort;  // the effort rendered ("" when not thinking)
  // Constrained decoding (serve/turn_constraint.h): on for a JSON response_format (its schema here;
  // json_object: any object), for tool_choice "none" (no tools block; free text when no schema) and
  // for a forced call.
  bool constrained = false;
  std::shared_ptr<const JsonSchema> schema;
  // tool_choice "required" (every declared tool) or a named function: the one call is forced.
  std::vector<ForcedTool> forced;
};

// /v1/completions: a prompt as text or as token ids.
struct CompletionRequest {
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;  // non-empty: the prompt was given as ids
  GenerationRequest gen;
};

// The server's side of validation: the model id requests may name, the default for max_tokens, and K3's
// fixed sampling (`k3 serve --k3-sampling`): temperature 1.0 when thinking and 0.6 when not, top_p 0.95,
// penalties 0 and n 1 are what every request samples with; a request naming another value gets a 400.
struct ApiLimits {
  std::string model_id;
  int64_t default_max_tokens = 512;
  bool k3_sampling = false;
};

// Parse and validate a body; throw ApiError (400 for bad fields, 404 for another model's name).
ChatRequest parse_chat_request_body(std::string_view text, const ApiLimits& limits);
CompletionRequest parse_completion_request_body(std::string_view text, const ApiLimits& limits);

// The length of the longest prefix of s that ends on a whole UTF-8 character (a character cut by
// the end of the generated text so far is held back rather than sent as invalid UTF-8).
size_t utf8_complete_prefix(std::string_view s);

// The first position in `text` where one of `stops` begins, or npos.
size_t find_stop(std::string_view text, const std::vector<std::string>& stops);

// How many trailing bytes of `text` could still become the start of a stop string (held back while
// streaming, so text a stop string later cuts is never sent).
size_t stop_holdback(std::string_view text, const std::vector<std::string>& stops);

// JSON text of a response body, invalid UTF-8 replaced (a model can emit bytes that are not UTF-8).
std::string dump(const nlohmann::ordered_json& j);

}  // namespace k3::serve
