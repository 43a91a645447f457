// Log-probabilities of generated tokens for `k3 serve` (OpenAI's `logprobs` / `top_logprobs`), and
// their JSON in the shapes of the chat and the completions endpoints.
//
// A token's log-probability is the model's: log_softmax of the step's logits, before temperature,
// top-k or top-p (what the model assigns, whatever the request samples with), computed in double and
// reported as a float. The alternatives are the step's n most probable ids, the most probable first
// (ties toward the lower id), whether or not the chosen id is among them.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace k3::serve {

struct TokenLogprob {
  int32_t id = 0;
  double logprob = 0.0;
  std::vector<std::pair<int32_t, double>> top;  // (id, logprob), most probable first
};

// The chosen id's log-probability under logits [V] and the n_top most probable ids (n_top >= 0).
TokenLogprob token_logprob(const float* logits, int64_t V, int32_t chosen, int n_top);

// A token's text as the API shows it: its bytes (a special token's text), or "token_id:N" for an id the
// tokenizer does not have (a model's vocabulary can be padded past it).
std::string token_text(const Tokenizer& tok, int32_t id);

// Chat: the `content` array of choices[].logprobs, one entry per token:
// {"token", "logprob", "bytes": [...], "top_logprobs": [{"token", "logprob", "bytes"}, ...]}.
nlohmann::ordered_json chat_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps);

// Completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob, ...}], "text_offset"},
// the offsets in bytes of the completion's text, starting at `offset`, which is left past these
// tokens (a stream's next chunk starts there).
nlohmann::ordered_json completion_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps, int64_t& offset);

}  // namespace k3::serve
