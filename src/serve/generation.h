// One request's generation for `k3 serve`: the prompt tokenised as the endpoint says, tokens sampled
// until the message ends, a stop string, eos or max_tokens, and what is final sent out as it comes.
// No HTTP here: serve/server.cpp calls these from its handlers, the tests call them directly.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/engine.h"
#include "multimodal/media_prompt.h"
#include "serve/logprobs.h"
#include "serve/openai_api.h"
#include "serve/turn_constraint.h"
#include "tokenizer/tokenizer.h"

namespace k3::serve {

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens the prefix cache supplied (set by the server)
  // {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details": {"cached_tokens"}}
  nlohmann::ordered_json to_json() const;
};

struct Timing {
  double first_token_seconds = 0.0;  // request start (before the prefill) to the first sampled token
  double decode_seconds = 0.0;       // first token to the last
};

// New text of the assistant's two channels since the previous call, and (when the request asked for
// log-probabilities) the entries of the tokens generated since then.
struct ChatDelta {
  std::string reasoning, content;
  std::vector<TokenLogprob> logprobs;
};

// New completion text since the previous call, with its tokens' log-probabilities as ChatDelta's.
struct TextDelta {
  std::string text;
  std::vector<TokenLogprob> logprobs;
};

struct ChatResult {
  nlohmann::ordered_json message;  // OpenAI's assistant message: content, reasoning_content, tool_calls
  std::string finish_reason;       // "stop", "length" or "tool_calls"
  Usage usage;
  Timing timing;
  std::vector<TokenLogprob> logprobs;  // every generated token's, when asked for (think channel included)
  bool timed_out = false;              // stopped at the request's deadline (finish_reason "length")
};

struct TextResult {
  std::string text;
  std::string finish_reason;  // "stop" or "length"
  Usage usage;
  Timing timing;
  std::vector<TokenLogprob> logprobs;  // every generated token's, when asked for
  bool timed_out = false;              // stopped at the request's deadline (finish_reason "length")
};

// A request's prompt ids and how many tokens it may generate, checked before anything is sent: a bad
// message (render_chat's errors), ids outside the vocabulary, a prompt that leaves no room in the
// model's context, or max_tokens past it throw ApiError (400).
// A chat request's images (data URLs) are decoded, preprocessed and encoded by `vision` here (a 400 when
// there is none or an image cannot be read): ids then hold each image's <|media_pad|> once per projected token
// (multimodal/media_prompt.h), and `media` the rows that go in there.
struct PreparedPrompt {
  std::vector<int32_t> ids;
  int64_t budget = 0;
  std::shared_ptr<const MediaPrompt> media;  // null without images
};
PreparedPrompt prepare_chat(const K3Config& cfg, const Tokenizer& tok, const ChatRequest& req,
                            const VisionEncoder* vision = nullptr);
PreparedPrompt prepare_completion(const K3Config& cfg, const Tokenizer& tok, const CompletionRequest& req);

// emit(...) receives text once it is final: never a cut UTF-8 character, never text that a stop string
// could still remove. Returning false cancels the request (the client went away): generation stops
// and the result says what was made so far. Stop strings apply to the content (not the reasoning);
// the text is cut before the stop string, which is not returned. With log-probabilities asked for,
// each delta carries the entries of the tokens generated since the previous one, and a last delta
// (possibly without text) the rest: over a stream they are every generated token's, in order.
// A constrained request (ChatRequest::constrained) samples only what keeps the turn in its grammar
// (serve/turn_constraint.h) over `trie`, the tokenizer's (built here when null).
// `append` runs the model on one fresh sequence (Engine::pick_session, or a batcher's slot: serve/batcher.h), and
// `ahead` (optional, over the same sequence) lets its decode steps run ahead of the request's work on each token
// when the engine picks (generate_until).
ChatResult run_chat(const K3Config& cfg, const PickFn& append, const RunAhead& ahead, const Tokenizer& tok,
                    const ChatRequest& req, const PreparedPrompt& prompt,
                    const std::function<bool(const ChatDelta&)>& emit = {}, const TokenTrie* trie = nullptr);
TextResult run_completion(const K3Config& cfg, const PickFn& append, const RunAhead& ahead, const Tokenizer& tok,
                          const CompletionRequest& req, const PreparedPrompt& prompt,
                          const std::function<bool(const TextDelta&)>& emit = {});

}  // namespace k3::serve
