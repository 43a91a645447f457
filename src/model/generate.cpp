#include "model/generate.h"

#include <chrono>

#include "core/error.h"

namespace k3 {

GenerateResult generate(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token) {
  return generate_until(append, cfg, prompt, max_new_tokens, sampler, [&](int32_t id) {
    if (on_token) on_token(id);
    return true;
  });
}

GenerateResult generate_until(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                              int64_t max_new_tokens, Sampler& sampler, const std::function<bool(int32_t)>& keep_going,
                              const StepObserver& observe, const LogitsMask& mask) {
  K3_CHECK(!prompt.empty(), "generate: the prompt is empty");
  K3_CHECK(max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ", max_new_tokens);
  const int64_t V = cfg.vocab_size, eos = cfg.eos_token_id;
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  if (max_new_tokens == 0) return r;
  auto t0 = clock::now();
  std::vector<float> logits = append(prompt);
  r.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  t0 = clock::now();
  std::vector<float> masked;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    if (mask) {
      masked = logits;
      mask(masked.data(), V);
    }
    const int32_t next = sampler.sample(mask ? masked.data() : logits.data(), V);
    r.tokens.push_back(next);
    if (observe) observe(logits.data(), V, next);
    const bool go_on = keep_going ? keep_going(next) : true;
    if (next == eos) {
      r.stopped_on_eos = true;
      break;
    }
    if (!go_on) {
      r.stopped_by_caller = true;
      break;
    }
    if (i + 1 < max_new_tokens) logits = append({next});
  }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return r;
}

}  // namespace k3
