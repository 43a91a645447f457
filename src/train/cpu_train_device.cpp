// The float64 CPU trainer behind train_device.h: gradient lanes, the CPU optimizer, CPU balancers.
#include <algorithm>
#include <functional>

#include "core/error.h"
#include "model/training/model_train.h"
#include "train/grad_lanes.h"
#include "train/train_device.h"

namespace k3::train {

namespace {

class CpuTrainDevice final : public TrainDevice {
 public:
  CpuTrainDevice(ParamStore& P, const K3Config& c, Optimizer& optimizer, const BalanceOptions& balance, int64_t lanes)
      : P_(P), c_(c), optimizer_(optimizer), lanes_(P, lanes) {
    const std::vector<std::vector<double>> bias = router_biases(P, c);
    bal_.resize(bias.size());
    for (size_t l = 0; l < bias.size(); ++l)
      if (!bias[l].empty())
        bal_[l] = std::make_unique<QuantileBalancer>(c.num_experts, c.num_experts_per_token, balance, bias[l]);
    router_bias_ = [this](int64_t l) { return bal_[size_t(l)]->bias().data(); };
  }

  std::string describe() const override {
    return "cpu (float64, " + std::to_string(lanes_.lanes()) + " gradient lane" + (lanes_.lanes() == 1 ? "" : "s") +
           ")";
  }

  double gradients(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained,
                   double grad_scale) override {
    P_.zero_grads();
    return lanes_.step(
        c_, pieces, grad_scale, router_bias_,
        [&](int64_t l, const double* s, int64_t N) { bal_[size_t(l)]->accumulate(s, N); }, trained);
  }

  double clip(double max_norm, std::string* bad) override {
    const double norm = clip_grad_norm(P_, max_norm);
    *bad = first_nonfinite_tensor(P_, /*gradients=*/true);
    return norm;
  }

  std::vector<double> finish_balance() override {
    std::vector<double> maxvio;
    for (auto& b : bal_)
      if (b) maxvio.push_back(b->finish_step().max_vio);
    return maxvio;
  }

  std::string update(double lr) override {
    optimizer_.step(P_, lr);
    return first_nonfinite_tensor(P_, /*gradients=*/false);
  }

  double forward_loss(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained) override {
    TrainHooks hooks;  // route with the current biases; nothing is accumulated
    hooks.router_bias = router_bias_;
    return forward_losses(P_, c_, pieces, &hooks, trained);
  }

  std::vector<std::vector<double>> token_logprobs(const std::vector<std::vector<int32_t>>& pieces,
                                                  const std::vector<RouterReplay>* replay,
                                                  std::vector<RouterReplay>* topk) override {
    return forward_logprobs(P_, c_, pieces, router_bias_, replay, topk);
  }

  double weighted_gradients(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>& trained,
                            const std::vector<TokenWeights>& weights,
                            const std::vector<RouterReplay>* replay) override {
    P_.zero_grads();
    return lanes_.step(
        c_, pieces, 1.0, router_bias_,
        [&](int64_t l, const double* s, int64_t N) { bal_[size_t(l)]->accumulate(s, N); }, &trained, &weights, replay);
  }

  void store_values(ParamStore& P) override {
    K3_CHECK(&P == &P_, "CpuTrainDevice: another parameter store");  // the values are P's already
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      if (bal_[size_t(l)]) store_router_bias(P, c_, l, bal_[size_t(l)]->bias());
  }

  void save_state(ParamStore& P, OptimizerState& optimizer, nlohmann::json& balancers) override {
    store_values(P);
    optimizer = optimizer_.save_state();
    balancers = nlohmann::json::object();
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      if (bal_[size_t(l)]) balancers[std::to_string(l)] = bal_[size_t(l)]->to_json();
  }

  void load_state(const OptimizerState& optimizer, const nlohmann::json& balancers) override {
    optimizer_.load_state(optimizer);
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      if (bal_[size_t(l)]) *bal_[size_t(l)] = QuantileBalancer::from_json(balancers.at(std::to_string(l)));
  }

 private:
  ParamStore& P_;
  const K3Config& c_;
  Optimizer& optimizer_;
  std::vector<std::unique_ptr<QuantileBalancer>> bal_;
  GradLanes lanes_;
  std::function<const double*(int64_t)> router_bias_;
};

}  // namespace

std::unique_ptr<TrainDevice> make_cpu_train_device(ParamStore& P, const K3Config& c, Optimizer& optimizer,
                                                   const BalanceOptions& balance, int64_t lanes) {
  return std::make_unique<CpuTrainDevice>(P, c, optimizer, balance, lanes);
}

}  // namespace k3::train
