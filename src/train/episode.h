// Multi-turn episodes for agentic RL (`k3 rl`, train/rl_loop.h): the policy, on an inference engine
// (model/engine.h), writes assistant messages in XTML; an environment (train/environment.h) runs their tool calls;
// the results go back into the conversation, until an answer, a budget or a failure ends the episode.
//
// Batching: every episode not yet done is one sequence of the engine, and each engine call steps them all
// together (the prompt, or a turn's tool results, as one prefill chunk; otherwise one decode token). An episode's
// draws depend only on its own seed and position (draw t of an episode is a function of (seed, t)), so its tokens
// do not depend on which others share the batch, and an episode carried into the next iteration (partial
// rollouts) continues exactly where it stopped.
//
// Token bookkeeping, per position of `ids`: whether the policy sampled it (`sampled`; the prompt and tool results
// are not), the log-probability the sampler gave it (`logp`, at the rollout temperature, no top-k or top-p: the
// policy's own), which iteration's policy sampled it (`policy`, so a partial rollout's older tokens are trained
// with their own behaviour log-probabilities and clipped ratios), the dense rewards credited at it (`reward`), and
// with router replay the experts every MoE layer chose for it (`routing`).
//
// A turn continues the conversation exactly as the chat template renders it: the tokens after an assistant's tool
// calls are the rendering of the tool results and the next generation prompt (the segments after the conversation
// through the assistant message), while the assistant's own tokens stay the ids it sampled.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/engine.h"
#include "model/training/model_train.h"
#include "tokenizer/tokenizer.h"
#include "train/environment.h"

namespace k3::train {

struct EpisodeOptions {
  int64_t max_tokens = 256;  // tokens the policy writes in an episode, over all its turns
  int64_t max_turns = 4;     // assistant messages in an episode
  float temperature = 1.0f;  // the sampling policy: softmax(logits / T), nothing cut
  bool greedy = false;       // argmax instead (held-out evaluation); logp is still softmax(logits / T)'s
  bool record_routing = false;
  int64_t max_context = 0;  // tokens of an episode's sequence (0: the config's max_position_embeddings)
};

struct Episode {
  int64_t task_index = 0, sample = 0;  // which task of the environment's stream, which of its samples
  Task task;
  uint64_t seed = 0;                  // the episode's draws
  nlohmann::ordered_json messages;    // the conversation: the request's messages, then every finished turn
  std::vector<int32_t> ids;           // all the policy has read and written
  TokenMask sampled;                  // [ids]: written by the policy
  std::vector<double> logp;           // [ids]: the sampler's log-probability of each sampled token (0 elsewhere)
  std::vector<int32_t> policy;        // [ids]: the iteration whose policy sampled the token (-1: not sampled)
  std::vector<double> reward;         // [ids]: dense rewards credited at the token (a tool call's: its turn's end)
  RouterReplay routing;               // per layer, [ids, K] experts (record_routing; empty otherwise)
  int64_t prompt_len = 0;             // tokens of the task's request
  int64_t turn_begin = 0;             // where the assistant message being written begins
  nlohmann::json state;               // the environment's state of this episode
  int64_t turns = 0, tool_calls = 0;  // assistant messages finished, tool calls run
  bool done = false;
  std::string end;            // how it ended: "answer", "max_tokens", "max_turns", "context", "tool_error"
  std::string error;          // a tool's failure (end == "tool_error")
  double outcome = 0;         // score() of the answer (0 unless end == "answer")
  int64_t generated() const;  // tokens the policy sampled
  double dense_reward() const;

  nlohmann::json to_json() const;  // everything above, for a checkpoint
  static Episode from_json(const nlohmann::json& j);
};

// A fresh episode of `task`: its request rendered with the generation prompt (errors name the task).
Episode start_episode(const Tokenizer& tok, const Task& task, int64_t task_index, int64_t sample, uint64_t seed);

struct RolloutStats {
  int64_t sampled = 0;       // tokens the policy sampled
  int64_t prefilled = 0;     // prompt and tool-result tokens run through the engine
  int64_t engine_calls = 0;  // batched forwards
  double seconds = 0.0;      // wall time, tools included
  double tool_seconds = 0.0;
};

// Steps the episodes that are not done, together, until all are done or `stop_after_done` of `episodes` are (the
// partial-rollout cut; <= 0: all). Tokens sampled here are marked with `policy_version`. The engine starts every
// episode's sequence afresh (a carried episode is prefilled again under the current policy).
RolloutStats run_episodes(Engine& engine, const Tokenizer& tok, Environment& env, std::vector<Episode*>& episodes,
                          const EpisodeOptions& options, int32_t policy_version, int64_t stop_after_done);

// The tokens that follow an assistant message whose tool calls have run: the rendering of the conversation
// `with_results` (the messages `through_assistant`, then the tool messages) with the generation prompt, after the
// rendering of `through_assistant` alone. A k3::Error when the template does not render one as a prefix of the
// other.
std::vector<int32_t> turn_continuation(const Tokenizer& tok, const Task& task,
                                       const nlohmann::ordered_json& through_assistant,
                                       const nlohmann::ordered_json& with_results);

// Whether a request has the model think first (the chat template's `thinking`, default true): where the parse of
// an assistant message starts.
bool request_thinks(const nlohmann::ordered_json& request);

}  // namespace k3::train
