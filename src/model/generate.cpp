#include "model/generate.h"

#include <chrono>

#include "core/error.h"

namespace k3 {

GenerateResult generate(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token) {
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
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const int32_t next = sampler.sample(logits.data(), V);
    r.tokens.push_back(next);
    if (on_token) on_token(next);
    if (next == eos) {
      r.stopped_on_eos = true;
      break;
    }
    if (i + 1 < max_new_tokens) logits = append({next});
  }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return r;
}

}  // namespace k3
