// Supervised fine-tuning data (`k3 sft`): chat conversations, one per line of a JSONL file, each the OpenAI-style
// chat request object the chat template reads (tokenizer/xtml_chat.h): `messages` with system, user, assistant
// (content, reasoning_content, tool_calls) and tool turns, and optionally `tools`, `thinking`, `thinking_effort`,
// `tool_choice`, `response_format`.
//
// Each conversation is rendered in XTML exactly as a chat request is for generation, without the generation
// prompt, and encoded segment by segment. Its trained tokens are the assistant's (ChatSegment::assistant): in
// every assistant message, what the model writes after a generation prompt (the think channel's body, the
// response, the tool calls, the closing tags and <|end_of_msg|>); the system, user and tool turns and each
// assistant message's header are context only. A conversation is one sequence: packed into a step beside
// others, nothing crosses between them (the trainer runs each piece on its own, train/trainer.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/training/model_train.h"

namespace k3 {
class Tokenizer;
}

namespace k3::train {

struct SftExample {
  std::vector<int32_t> ids;
  TokenMask trained;  // [ids.size()]: the assistant's tokens
  int64_t line = 0;   // 1-based line of the file
};

struct SftData {
  std::vector<SftExample> examples;
  int64_t conversations = 0;   // lines read
  int64_t truncated = 0;       // cut at max_len
  int64_t untrained = 0;       // dropped: no assistant token within max_len
  int64_t tokens = 0;          // of the examples kept
  int64_t trained_tokens = 0;  // targets: trained tokens after each example's first token
};

// Reads `path`. Conversations longer than max_len tokens are cut to their first max_len (counted in truncated);
// one with no trained token left is dropped (counted in untrained). Errors name path:line and the field: a line
// that is not a chat request, a request that asks for the generation prompt (add_generation_prompt true: a
// training conversation ends with its last message), an image part (k3 sft trains text only), a conversation
// without an assistant message, a token id at or past vocab_size, or a file with nothing to train.
SftData load_sft_data(const std::string& path, const Tokenizer& tok, int64_t vocab_size, int64_t max_len);

// The steps of `epochs` passes over examples of these lengths. Each epoch visits every example once, in file order
// or (shuffle) in a permutation drawn from (seed, epoch), and is cut into steps of consecutive examples holding at
// most tokens_per_step tokens (an example longer than that is a step of its own); a step never spans two epochs.
// Step s holds order[step_begin[s] .. step_begin[s + 1]).
struct SftPlan {
  std::vector<int64_t> order;       // example indices, epoch after epoch
  std::vector<int64_t> step_begin;  // [steps + 1]
  int64_t steps() const { return int64_t(step_begin.size()) - 1; }
};
SftPlan plan_sft_steps(const std::vector<int64_t>& lengths, int64_t epochs, int64_t tokens_per_step, bool shuffle,
                       uint64_t seed);

}  // namespace k3::train
