#include "serve/logprobs.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "kernels/loss/cross_entropy.h"

namespace k3::serve {

using ojson = nlohmann::ordered_json;

TokenLogprob token_logprob(const float* logits, int64_t V, int32_t chosen, int n_top) {
  K3_CHECK(V > 0 && chosen >= 0 && chosen < V && n_top >= 0, "token_logprob: bad arguments (V ", V, ", id ", chosen,
           ", n_top ", n_top, ")");
  // log_softmax: x - (max + log Σ exp(x - max)), in double. A -inf logit (a masked id) gets -inf.
  const double lse = log_sum_exp(logits, V);
  TokenLogprob t;
  t.id = chosen;
  t.logprob = double(logits[chosen]) - lse;
  const int64_t n = std::min<int64_t>(n_top, V);
  if (n > 0) {
    std::vector<int32_t> ids(static_cast<size_t>(V));
    for (int64_t i = 0; i < V; ++i) ids[size_t(i)] = int32_t(i);
    auto more_probable = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), more_probable);
    for (int64_t i = 0; i < n; ++i) t.top.emplace_back(ids[size_t(i)], double(logits[ids[size_t(i)]]) - lse);
  }
  return t;
}

std::string token_text(const Tokenizer& tok, int32_t id) {
  if (id >= 0 && id < tok.vocab_size()) {
    try {
      return tok.decode({id});
    } catch (const Error&) {  // a reserved id with no text
    }
  }
  return "token_id:" + std::to_string(id);
}

namespace {

// A log-probability as JSON: a number, or OpenAI's -9999 for -inf (JSON has no infinities).
ojson lp_json(double lp) { return std::isfinite(lp) ? ojson(float(lp)) : ojson(-9999.0); }

ojson bytes_json(const std::string& s) {
  ojson b = ojson::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

}  // namespace

ojson chat_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps) {
  ojson content = ojson::array();
  for (const TokenLogprob& t : lps) {
    const std::string text = token_text(tok, t.id);
    ojson top = ojson::array();
    for (const auto& [id, lp] : t.top) {
      const std::string alt = token_text(tok, id);
      top.push_back(ojson{{"token", alt}, {"logprob", lp_json(lp)}, {"bytes", bytes_json(alt)}});
    }
    content.push_back(
        ojson{{"token", text}, {"logprob", lp_json(t.logprob)}, {"bytes", bytes_json(text)}, {"top_logprobs", top}});
  }
  return content;
}

ojson completion_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps, int64_t& offset) {
  ojson tokens = ojson::array(), token_lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  for (const TokenLogprob& t : lps) {
    const std::string text = token_text(tok, t.id);
    tokens.push_back(text);
    token_lps.push_back(lp_json(t.logprob));
    ojson top = ojson::object();
    for (const auto& [id, lp] : t.top) top[token_text(tok, id)] = lp_json(lp);
    tops.push_back(top);
    offsets.push_back(offset);
    offset += int64_t(text.size());
  }
  return ojson{{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

}  // namespace k3::serve
