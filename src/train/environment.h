// Environments of agentic RL (`k3 rl`, train/rl_loop.h): where an episode's tasks come from, what its tool calls
// do, and what it scores.
//
// An episode starts from a task's chat request (messages and the tools the model may call, rendered in XTML as for
// generation). Each time the policy ends an assistant message with complete tool calls, the environment runs every
// call and its results go back into the conversation as tool messages; the policy then writes the next assistant
// message. The episode ends when an assistant message has no tool call (the answer, scored by score()), when it
// runs out of turns or tokens, or when a tool fails.
//
// Rewards: score() gives the outcome reward of the final answer; a tool call may carry a dense reward of its own
// (ToolOutcome::reward, e.g. one per correct intermediate lookup), credited at the tokens of the call that earned
// it (train/episode.h).
//
// Failure: a tool that crashes, hangs past its timeout or answers garbage gives ToolOutcome::error. The episode then
// ends with that error recorded (it trains as an episode with no outcome reward); the run goes on. Environments
// report their own failures this way rather than throwing; a throw from call() is treated the same.
//
// State: each episode has a JSON object of its own (null at the start) that call() and score() may read and update
// (e.g. which facts were looked up), saved with the run's checkpoints so that resumed episodes continue exactly.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/xtml_parse.h"

namespace k3::train {

struct Task {
  nlohmann::ordered_json request;  // OpenAI-style chat request: messages, tools (and thinking options)
  nlohmann::json answer;           // what score() checks, never shown to the policy
  // A reference solution (null: none): the assistant and tool messages that follow `request`'s messages, in the
  // request's own shape. Rendered after the request it is a supervised fine-tuning conversation (`k3 rl tasks
  // --transcripts`), and its assistant tokens are b0(x), the budget the effort reward measures against.
  nlohmann::ordered_json reference;
};

struct ToolOutcome {
  std::string content;  // the tool message's content
  double reward = 0.0;  // a dense reward credited to this call
  std::string error;    // non-empty: the tool failed; the episode ends with this recorded
};

class Environment {
 public:
  virtual ~Environment() = default;
  virtual std::string name() const = 0;
  // Task `index` of the environment's stream, a function of (seed, index) only.
  virtual Task task(uint64_t seed, int64_t index) = 0;
  // Runs one tool call of an episode of `task`. `state`: the episode's state (see above).
  virtual ToolOutcome call(const Task& task, const std::string& tool, const nlohmann::ordered_json& arguments,
                           nlohmann::json& state) = 0;
  // The outcome reward of the episode's final assistant message (one without tool calls). May throw when the
  // scoring itself fails (e.g. a user's reward tool): the episode then ends as a tool error, the run goes on.
  virtual double score(const Task& task, const XtmlAssistantMessage& answer, const nlohmann::json& state) = 0;
};

// The built-in environments, each from its own settings (documented with its factory).
std::unique_ptr<Environment> make_calculator_environment(const nlohmann::json& options);
std::unique_ptr<Environment> make_kb_environment(const nlohmann::json& options);
std::unique_ptr<Environment> make_retrieval_environment(const nlohmann::json& options);

// The built-in environments' option checks, their errors beginning "<env> environment: ": every key is one of
// `known` (the error lists them); an integer option lies in [lo, hi] (`fallback` when it is absent).
void check_option_names(const nlohmann::json& options, const char* env, std::initializer_list<const char*> known);
int64_t integer_option(const nlohmann::json& options, const char* env, const char* key, int64_t fallback, int64_t lo,
                       int64_t hi);

// The last integer written in `text` (with a '-' directly before its digits), or false: how the built-in tasks
// read a numeric answer.
bool last_integer(const std::string& text, std::string* out);

// The built-in environments by name ("calculator", "kb", "retrieval"); `options` are the environment's own
// settings (documented with each). A k3::Error lists the names when `name` is none of them.
std::unique_ptr<Environment> make_environment(const std::string& name, const nlohmann::json& options);

}  // namespace k3::train
