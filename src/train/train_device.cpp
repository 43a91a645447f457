// What both training devices share (train_device.h): where the router balancers start, and where
// their biases go back for a checkpoint.
#include "train/train_device.h"

#include <algorithm>

#include "core/error.h"
#include "model/tensor_table.h"

namespace k3::train {

std::vector<std::vector<double>> router_biases(const ParamStore& P, const K3Config& c) {
  const TensorNames tn{param_naming(P)};
  std::vector<std::vector<double>> out(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (c.is_moe_layer(l)) {
      const double* b = P.p(tn(TensorKind::MoeRouterBias, l), c.num_experts);
      out[size_t(l)].assign(b, b + c.num_experts);
    }
  return out;
}

std::vector<std::pair<size_t, size_t>> micro_batches(const std::vector<std::vector<int32_t>>& pieces,
                                                     int64_t max_tokens) {
  std::vector<std::pair<size_t, size_t>> runs;
  if (pieces.empty()) return runs;
  if (max_tokens <= 0) return {{0, pieces.size()}};
  size_t begin = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t n = int64_t(pieces[i].size());
    if (i > begin && tokens + n > max_tokens) {
      runs.emplace_back(begin, i);
      begin = i, tokens = 0;
    }
    tokens += n;
  }
  runs.emplace_back(begin, pieces.size());
  return runs;
}

void store_router_bias(ParamStore& P, const K3Config& c, int64_t layer, const std::vector<double>& bias) {
  const TensorNames tn{param_naming(P)};
  K3_CHECK(int64_t(bias.size()) == c.num_experts, "store_router_bias: ", bias.size(), " values for ", c.num_experts,
           " experts");
  std::copy(bias.begin(), bias.end(), P.p_mut(tn(TensorKind::MoeRouterBias, layer), c.num_experts));
}

}  // namespace k3::train
