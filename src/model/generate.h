// Autoregressive generation for one sequence: prefill the prompt into a fresh cache, then feed
// one token per step (the KDA state and MLA latent cache carry the prefix; nothing is recomputed).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/sampler.h"

namespace k3 {

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (the eos id included when it stopped the run)
  bool stopped_on_eos = false;
  bool stopped_by_caller = false;  // generate_until's keep_going said no
  double prefill_seconds = 0.0, decode_seconds = 0.0;
};

// append(tokens) appends tokens to the one sequence being generated and returns the logits [V] of its
// last token (Engine::session gives one).
using AppendFn = std::function<std::vector<float>(const std::vector<int32_t>& tokens)>;

// How a step's caller wants the next token of a sequence chosen (Engine::forward_pick, Slot::step): by the
// engine, greedy or at a temperature alone with the draw `uniform` (Sampler::next_uniform; the GPU samples on the
// device, so only the id comes back), and/or from the last logits it returns.
struct TokenPick {
  bool pick = false;         // the engine chooses the id
  bool greedy = true;        // argmax, ties to the lower id; else sample_temperature (model/sampler.h)
  float temperature = 1.0f;  // > 0 (sampling)
  double uniform = 0.0;      // the draw in [0, 1) (sampling)
  bool want_logits = false;  // the last logits [V] come back too
  // Sampling only: the log-probability of the id under softmax(logits / temperature) comes back too (an RL
  // rollout's behaviour log-probability, without the logits leaving the device).
  bool want_logprob = false;
  static TokenPick logits() { return TokenPick{false, true, 1.0f, 0.0, true}; }
  static TokenPick none() { return TokenPick{false, true, 1.0f, 0.0, false}; }  // a prompt chunk's middle
};
struct PickResult {
  int32_t id = -1;            // when pick
  std::vector<float> logits;  // when want_logits
  double logprob = 0.0;       // when want_logprob
};
// append(tokens, pick): appends tokens to the one sequence being generated and returns what `pick` asks of its
// last token.
using PickFn = std::function<PickResult(const std::vector<int32_t>& tokens, const TokenPick& pick)>;
// Decode steps an appender may run ahead of its caller (serve/batcher.h's slots): once started, each step appends
// the id the previous one picked and picks again, without waiting for the caller, so that the caller's work on a
// token (detokenising, writing to a client) overlaps the forward of the next. Only for picks the engine makes
// (TokenPick::pick): the caller has nothing to add between steps.
struct RunAhead {
  // Appends `first`, then each id picked, picking with next_pick() each time (called in step order, under the
  // appender's lock, never after stop() returns): at most `steps` steps, none after one that picked `stop_id`.
  std::function<void(int32_t first, int64_t steps, int32_t stop_id, std::function<TokenPick()> next_pick)> start;
  std::function<PickResult()> next;  // the next step's result, in order; blocks until it is there
  // No further steps. The sequence then holds every step run, possibly past those whose results were taken: the
  // appender is not to be stepped further.
  std::function<void()> stop;
  explicit operator bool() const { return bool(start); }
};

// An AppendFn as a PickFn (picks on the host, model/sampler.h), and the other way round.
PickFn pick_fn(AppendFn append);
AppendFn append_fn(PickFn pick);
// What `pick` asks of these logits, on the host: the engine-independent definition Engine::forward_pick follows.
PickResult pick_on_host(std::vector<float> logits, const TokenPick& pick);

// Generation over `append` (Engine::pick_session gives one; model/engine.h has generate() on an Engine).
// on_token (optional) is called with each new id as soon as it is chosen.
GenerateResult generate(const PickFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token = {});
GenerateResult generate(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token = {});

// Sees each step's logits [V] (the model's, before any sampling transform) and the id chosen from them.
using StepObserver = std::function<void(const float* logits, int64_t V, int32_t id)>;

// Masks a step's logits in place before sampling (-inf on the ids that may not come next).
using LogitsMask = std::function<void(float* logits, int64_t V)>;

// generate() whose caller decides after each new id whether to go on: keep_going(id) returning false
// ends the run there (the id is kept; stopped_by_caller is set), as a stop string or a closed
// connection does for the server. Otherwise it stops as generate() does. observe (optional) is called
// with each step's logits (unmasked) and id before keep_going; mask (optional) restricts what the
// sampler may pick (constrained decoding).
// Without observe and mask, a greedy or temperature-only sampler lets the engine pick (TokenPick): on the GPU
// no logits then come to the host, and with `ahead` (of the same sequence as `append`) the decode steps after the
// first run ahead of keep_going; the ids are the same either way.
GenerateResult generate_until(const PickFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, Sampler& sampler, const std::function<bool(int32_t)>& keep_going,
                              const StepObserver& observe = {}, const LogitsMask& mask = {},
                              const RunAhead& ahead = {});
GenerateResult generate_until(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, Sampler& sampler, const std::function<bool(int32_t)>& keep_going,
                              const StepObserver& observe = {}, const LogitsMask& mask = {});

}  // namespace k3
