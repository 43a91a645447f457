#include "model/generate.h"

#include "kernels/loss/cross_entropy.h"

#include <chrono>

#include "core/error.h"

namespace k3 {

PickResult pick_on_host(std::vector<float> logits, const TokenPick& pick) {
  PickResult r;
  if (pick.pick) {
    const int64_t V = int64_t(logits.size());
    check_sampleable(logits.data(), V);
    if (pick.greedy) {
      r.id = argmax(logits.data(), V);
    } else {
      std::vector<double> prob;
      r.id = sample_temperature(logits.data(), V, pick.temperature, pick.uniform, prob);
      if (pick.want_logprob) r.logprob = log_softmax_at(logits.data(), V, r.id, pick.temperature);
    }
  }
  if (pick.want_logits) r.logits = std::move(logits);
  return r;
}

PickFn pick_fn(AppendFn append) {
  return [append = std::move(append)](const std::vector<int32_t>& t, const TokenPick& p) {
    return pick_on_host(append(t), p);
  };
}

AppendFn append_fn(PickFn pick) {
  return [pick = std::move(pick)](const std::vector<int32_t>& t) { return pick(t, TokenPick::logits()).logits; };
}

GenerateResult generate(const PickFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token) {
  return generate_until(append, cfg, prompt, max_new_tokens, sampler, [&](int32_t id) {
    if (on_token) on_token(id);
    return true;
  });
}

GenerateResult generate(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token) {
  return generate(pick_fn(append), cfg, prompt, max_new_tokens, sampler, on_token);
}

GenerateResult generate_until(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, Sampler& sampler, const std::function<bool(int32_t)>& keep_going,
                              const StepObserver& observe, const LogitsMask& mask) {
  return generate_until(pick_fn(append), cfg, prompt, max_new_tokens, sampler, keep_going, observe, mask);
}

GenerateResult generate_until(const PickFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, Sampler& sampler, const std::function<bool(int32_t)>& keep_going,
                              const StepObserver& observe, const LogitsMask& mask, const RunAhead& ahead) {
  K3_CHECK(!prompt.empty(), "generate: the prompt is empty");
  K3_CHECK(max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ", max_new_tokens);
  const int64_t V = cfg.vocab_size, eos = cfg.eos_token_id;
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  if (max_new_tokens == 0) return r;
  // The engine picks when nothing here needs the logits; a non-greedy pick takes the sampler's draw, as
  // sampler.sample would (one per token), so the ids are the sampler's whichever side picks.
  const bool engine_picks = !observe && !mask && sampler.temperature_only();
  const SamplingParams& sp = sampler.params();
  auto engine_pick = [&sampler, &sp] {
    TokenPick p;
    p.pick = true, p.want_logits = false, p.greedy = sp.greedy, p.temperature = sp.temperature;
    if (!sp.greedy) p.uniform = sampler.next_uniform();
    return p;
  };
  auto step = [&](const std::vector<int32_t>& tokens) {
    return append(tokens, engine_picks ? engine_pick() : TokenPick::logits());
  };
  // A run ahead draws from `sampler` on the appender's side until stopped: it stops before anything here ends.
  struct StopAhead {
    const RunAhead* on = nullptr;
    ~StopAhead() {
      if (on) on->stop();
    }
  } running;
  auto t0 = clock::now();
  PickResult out = step(prompt);
  r.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  t0 = clock::now();
  std::vector<float> masked;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    int32_t next = out.id;
    if (!engine_picks) {
      const std::vector<float>& logits = out.logits;
      if (mask) {
        masked = logits;
        mask(masked.data(), V);
      }
      next = sampler.sample(mask ? masked.data() : logits.data(), V);
      if (observe) observe(logits.data(), V, next);
    }
    r.tokens.push_back(next);
    const bool go_on = keep_going ? keep_going(next) : true;
    if (next == eos) {
      r.stopped_on_eos = true;
      break;
    }
    if (!go_on) {
      r.stopped_by_caller = true;
      break;
    }
    if (i + 1 >= max_new_tokens) continue;
    if (engine_picks && ahead) {
      if (!running.on) ahead.start(next, max_new_tokens - 1 - i, int32_t(eos), engine_pick), running.on = &ahead;
      out = ahead.next();
    } else {
      out = step({next});
    }
  }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return r;
}

}  // namespace k3
