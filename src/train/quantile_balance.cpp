#include "train/quantile_balance.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace k3::train {

namespace {

// Biased scores of one token sorted best first; ties to the lower expert index (as the router, kernels/moe/router.h).
void rank_token(const double* s, const double* bias, int64_t E, int64_t take, std::vector<double>& v,
                std::vector<int32_t>& order) {
  for (int64_t e = 0; e < E; ++e) v[size_t(e)] = s[e] + (bias ? bias[e] : 0.0);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int32_t a, int32_t b) {
    const double va = v[size_t(a)], vb = v[size_t(b)];
    return va > vb || (va == vb && a < b);
  });
}

// Mean subtracted with a long double sum: the result's mean is 0 up to rounding of the entries
// themselves (tests check a few ulps); the bias only matters through differences, but a drifting
// mean would show up in checkpoints and logs.
void centre(std::vector<double>& b) {
  // Two passes: the first subtraction rounds each entry at the scale of the old values; the second
  // removes the mean of those rounding errors at the scale of the centred values.
  for (int pass = 0; pass < 2; ++pass) {
    long double sum = 0;
    for (double x : b) sum += x;
    const double mean = double(sum / (long double)b.size());
    for (double& x : b) x -= mean;
  }
}

int64_t bin_of(double r, double lo, double w, int64_t B) {
  // r lies in (lo, lo + B·w) mathematically; clamp guards rounding at the ends.
  int64_t k = int64_t(std::floor((r - lo) / w));
  return std::clamp<int64_t>(k, 0, B - 1);
}

}  // namespace

const char* balance_method_name(BalanceMethod m) {
  switch (m) {
    case BalanceMethod::None: return "none";
    case BalanceMethod::QuantileExact: return "qb-exact";
    case BalanceMethod::QuantileHistogram: return "qb-histogram";
    case BalanceMethod::Sign: return "sign";
  }
  return "?";
}

BalanceMethod parse_balance_method(const std::string& s) {
  for (BalanceMethod m :
       {BalanceMethod::None, BalanceMethod::QuantileExact, BalanceMethod::QuantileHistogram, BalanceMethod::Sign})
    if (s == balance_method_name(m)) return m;
  fail("unknown balancing method '", s, "' (none, qb-exact, qb-histogram, sign)");
}

std::vector<int64_t> biased_topk_loads(const double* scores, int64_t N, int64_t E, int64_t k, const double* bias) {
  K3_CHECK(k >= 1 && k <= E, "top-k ", k, " must be in 1..", E);
  std::vector<int64_t> loads(static_cast<size_t>(E), 0);
  std::vector<double> v(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t i = 0; i < N; ++i) {
    rank_token(scores + i * E, bias, E, k, v, order);
    for (int64_t r = 0; r < k; ++r) ++loads[size_t(order[size_t(r)])];
  }
  return loads;
}

double max_violation(const std::vector<int64_t>& loads) {
  if (loads.empty()) return 0.0;
  const double total = double(std::accumulate(loads.begin(), loads.end(), int64_t(0)));
  if (total == 0) return 0.0;
  const double mean = total / double(loads.size());
  return (double(*std::max_element(loads.begin(), loads.end())) - mean) / mean;
}

QuantileBalancer::QuantileBalancer(int64_t num_experts, int64_t top_k, BalanceOptions opt,
                                   std::vector<double> initial_bias)
    : E_(num_experts), K_(top_k), opt_(opt), bias_(std::move(initial_bias)) {
  if (E_ < 2) fail("quantile balancer: need at least 2 experts, got ", E_);
  if (K_ < 1 || K_ >= E_)
    fail("quantile balancer: top-k ", K_, " must be in 1..", E_ - 1, " (α is the (k+1)-th score)");
  if (opt_.num_bins < 1) fail("quantile balancer: num_bins must be >= 1, got ", opt_.num_bins);
  if (!(opt_.ema_decay >= 0.0 && opt_.ema_decay < 1.0)) fail("quantile balancer: ema_decay must be in [0, 1)");
  if (!(opt_.sign_rate >= 0.0)) fail("quantile balancer: sign_rate must be >= 0");
  if (bias_.empty()) bias_.assign(static_cast<size_t>(E_), 0.0);
  if (int64_t(bias_.size()) != E_) fail("quantile balancer: bias has ", bias_.size(), " entries, expected ", E_);
  loads_.assign(static_cast<size_t>(E_), 0);
}

void QuantileBalancer::set_bias(const std::vector<double>& b) {
  if (tokens_ != 0) fail("quantile balancer: set_bias in the middle of a step (", tokens_, " tokens pending)");
  if (int64_t(b.size()) != E_) fail("quantile balancer: bias has ", b.size(), " entries, expected ", E_);
  bias_ = b;
}

void QuantileBalancer::accumulate(const double* scores, int64_t N) {
  if (N < 0) fail("quantile balancer: negative token count");
  if (N == 0) return;
  const bool exact = opt_.method == BalanceMethod::QuantileExact;
  const bool hist = opt_.method == BalanceMethod::QuantileHistogram;
  if (hist && hist_.empty()) start_histogram();
  std::vector<double> v(static_cast<size_t>(E_));
  std::vector<int32_t> order(static_cast<size_t>(E_));
  if (exact) r_.reserve(r_.size() + size_t(N * E_));
  for (int64_t i = 0; i < N; ++i) {
    const double* s = scores + i * E_;
    // Top-(k+1): the first k are the routes, the (k+1)-th biased score is the cutoff α_i.
    rank_token(s, bias_.data(), E_, K_ + 1, v, order);
    for (int64_t r = 0; r < K_; ++r) ++loads_[size_t(order[size_t(r)])];
    const double alpha = v[size_t(order[size_t(K_)])];
    if (exact) {
      for (int64_t e = 0; e < E_; ++e) r_.push_back(alpha - s[e]);
    } else if (hist) {
      for (int64_t e = 0; e < E_; ++e)
        ++hist_[size_t(e * opt_.num_bins + bin_of(alpha - s[e], hist_lo_, hist_w_, opt_.num_bins))];
    }
  }
  tokens_ += N;
}

void QuantileBalancer::start_histogram() {
  // The range comes from the bias in effect, which is fixed for the whole step, so every
  // micro-batch bins into the same grid and the counts can simply be added (or all-reduced).
  const auto [mn, mx] = std::minmax_element(bias_.begin(), bias_.end());
  hist_lo_ = *mn - 1.0;
  hist_w_ = (*mx - *mn + 2.0) / double(opt_.num_bins);
  hist_.assign(size_t(E_ * opt_.num_bins), 0);
}

void QuantileBalancer::merge_ranks(dist::Group& g) {
  if (g.size() == 1) return;
  g.all_reduce_sum(&tokens_, 1);
  g.all_reduce_sum(loads_.data(), E_);
  if (opt_.method == BalanceMethod::QuantileHistogram) {
    if (hist_.empty()) start_histogram();  // a rank whose sequences routed nothing still adds its zeros
    g.all_reduce_sum(hist_.data(), int64_t(hist_.size()));
  } else if (opt_.method == BalanceMethod::QuantileExact) {
    r_ = dist::all_gather(g, r_);
  }
}

std::vector<double> QuantileBalancer::estimate_exact() const {
  if (opt_.method != BalanceMethod::QuantileExact) fail("quantile balancer: the exact estimate needs method qb-exact");
  if (tokens_ == 0) fail("quantile balancer: no tokens accumulated in this step");
  const int64_t m = tokens_;
  // q = m·k/n kept as the exact fraction f + num/n.
  const int64_t f = (m * K_) / E_, num = (m * K_) % E_;
  const double t = double(num) / double(E_);
  std::vector<double> out(static_cast<size_t>(E_)), col(static_cast<size_t>(m));
  for (int64_t e = 0; e < E_; ++e) {
    for (int64_t i = 0; i < m; ++i) col[size_t(i)] = r_[size_t(i * E_ + e)];
    // Rank f+1 ascending (0-based f) = the (q+1)-th largest margin M = −r; f < m since k < n.
    std::nth_element(col.begin(), col.begin() + f, col.end());
    const double lo = col[size_t(f)];
    double hi = lo;
    if (num != 0 && f + 1 < m) hi = *std::min_element(col.begin() + f + 1, col.end());  // rank f+2
    out[size_t(e)] = num == 0 ? lo : (1.0 - t) * lo + t * hi;
  }
  return out;
}

std::vector<double> QuantileBalancer::estimate_histogram() const {
  if (tokens_ == 0) fail("quantile balancer: no tokens accumulated in this step");
  const int64_t B = opt_.num_bins;
  std::vector<int64_t> counts;
  double lo = hist_lo_, w = hist_w_;
  if (opt_.method == BalanceMethod::QuantileHistogram) {
    counts = hist_;
  } else if (opt_.method == BalanceMethod::QuantileExact) {
    // Same grid built from the stored r (lets tests compare both estimators on one step).
    const auto [mn, mx] = std::minmax_element(bias_.begin(), bias_.end());
    lo = *mn - 1.0;
    w = (*mx - *mn + 2.0) / double(B);
    counts.assign(size_t(E_ * B), 0);
    for (int64_t i = 0; i < tokens_; ++i)
      for (int64_t e = 0; e < E_; ++e) ++counts[size_t(e * B + bin_of(r_[size_t(i * E_ + e)], lo, w, B))];
  } else {
    fail("quantile balancer: the histogram estimate needs method qb-histogram or qb-exact");
  }
  const double q = double(tokens_ * K_) / double(E_);
  const int64_t target = (tokens_ * K_ + E_ - 1) / E_;  // ⌈q⌉, exact in integers
  std::vector<double> out(static_cast<size_t>(E_));
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t* h = counts.data() + e * B;
    int64_t c = 0, beta = 0;
    // ⌈q⌉ <= m and every token is counted once per expert, so the scan always stops inside.
    while (beta < B - 1 && c + h[beta] < target) c += h[beta++];
    const double frac = h[beta] > 0 ? std::clamp((q - double(c)) / double(h[beta]), 0.0, 1.0) : 0.0;
    out[size_t(e)] = lo + (double(beta) + frac) * w;
  }
  return out;
}

const BalanceStepStats& QuantileBalancer::finish_step() {
  last_ = BalanceStepStats{};
  last_.tokens = tokens_;
  last_.loads = loads_;
  last_.max_vio = max_violation(loads_);
  if (tokens_ > 0) {
    switch (opt_.method) {
      case BalanceMethod::None: break;
      case BalanceMethod::QuantileExact:
      case BalanceMethod::QuantileHistogram: {
        std::vector<double> bh = opt_.method == BalanceMethod::QuantileExact ? estimate_exact() : estimate_histogram();
        if (opt_.ema_decay > 0)
          for (int64_t e = 0; e < E_; ++e)
            bh[size_t(e)] = (1.0 - opt_.ema_decay) * bh[size_t(e)] + opt_.ema_decay * bias_[size_t(e)];
        centre(bh);
        bias_ = std::move(bh);  // replace, not increment
        break;
      }
      case BalanceMethod::Sign: {
        const double mean = double(tokens_ * K_) / double(E_);
        for (int64_t e = 0; e < E_; ++e) {
          const double err = mean - double(loads_[size_t(e)]);
          bias_[size_t(e)] += opt_.sign_rate * double((err > 0) - (err < 0));
        }
        break;
      }
    }
  }
  tokens_ = 0;
  std::fill(loads_.begin(), loads_.end(), 0);
  r_.clear();
  hist_.clear();
  ++steps_;
  return last_;
}

nlohmann::json QuantileBalancer::to_json() const {
  if (tokens_ != 0) fail("quantile balancer: checkpoint in the middle of a step (", tokens_, " tokens pending)");
  return nlohmann::json{{"format", "k3-quantile-balancer-v1"},
                        {"method", balance_method_name(opt_.method)},
                        {"num_experts", E_},
                        {"top_k", K_},
                        {"num_bins", opt_.num_bins},
                        {"sign_rate", opt_.sign_rate},
                        {"ema_decay", opt_.ema_decay},
                        {"steps", steps_},
                        {"bias", bias_}};
}

QuantileBalancer QuantileBalancer::from_json(const nlohmann::json& j) {
  try {
    if (j.at("format").get<std::string>() != "k3-quantile-balancer-v1")
      fail("quantile balancer state: unknown format '", j.at("format").get<std::string>(), "'");
    BalanceOptions o;
    o.method = parse_balance_method(j.at("method").get<std::string>());
    o.num_bins = j.at("num_bins").get<int64_t>();
    o.sign_rate = j.at("sign_rate").get<double>();
    o.ema_decay = j.at("ema_decay").get<double>();
    QuantileBalancer qb(j.at("num_experts").get<int64_t>(), j.at("top_k").get<int64_t>(), o,
                        j.at("bias").get<std::vector<double>>());
    qb.steps_ = j.at("steps").get<int64_t>();
    return qb;
  } catch (const nlohmann::json::exception& e) {
    fail("quantile balancer state: ", e.what());
  }
}

}  // namespace k3::train
