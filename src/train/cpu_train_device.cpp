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
  CpuTrainDevice(ParamStore& P, const K3Config& c, Optimizer& optimizer, const BalanceOptions& balance, int64_t lanes,
                 dist::Group* group)
      : P_(P), c_(c), optimizer_(optimizer), lanes_(P, lanes), group_(group && group->size() > 1 ? group : nullptr) {
    const std::vector<std::vector<double>> bias = router_biases(P, c);
    bal_.resize(bias.size());
    for (size_t l = 0; l < bias.size(); ++l)
      if (!bias[l].empty())
        bal_[l] = std::make_unique<QuantileBalancer>(c.num_experts, c.num_experts_per_token, balance, bias[l]);
    router_bias_ = [this](int64_t l) { return bal_[size_t(l)]->bias().data(); };
  }

  std::string describe() const override {
    std::string d =
        "cpu (float64, " + std::to_string(lanes_.lanes()) + " gradient lane" + (lanes_.lanes() == 1 ? "" : "s");
    if (group_) d += " per rank, data-parallel over " + std::to_string(group_->size()) + " ranks";
    return d + ")";
  }

  double gradients(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained,
                   double grad_scale) override {
    P_.zero_grads();
    const Share s = share(pieces, trained, nullptr, nullptr);
    const double loss = lanes_.step(
        c_, s.pieces(), grad_scale, router_bias_,
        [&](int64_t l, const double* sc, int64_t N) { bal_[size_t(l)]->accumulate(sc, N); }, s.trained());
    return sum_over_ranks(loss, /*gradients=*/true);
  }

  double clip(double max_norm, std::string* bad) override {
    const double norm = clip_grad_norm(P_, max_norm);
    *bad = first_nonfinite_tensor(P_, /*gradients=*/true);
    return norm;
  }

  std::vector<double> finish_balance() override {
    std::vector<double> maxvio;
    for (auto& b : bal_)
      if (b) {
        if (group_) b->merge_ranks(*group_);
        maxvio.push_back(b->finish_step().max_vio);
      }
    return maxvio;
  }

  std::string update(double lr) override {
    optimizer_.step(P_, lr, group_);
    return first_nonfinite_tensor(P_, /*gradients=*/false);
  }

  double forward_loss(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained) override {
    TrainHooks hooks;  // route with the current biases; nothing is accumulated
    hooks.router_bias = router_bias_;
    const Share s = share(pieces, trained, nullptr, nullptr);
    return sum_over_ranks(forward_losses(P_, c_, s.pieces(), &hooks, s.trained()), /*gradients=*/false);
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
    const Share s = share(pieces, &trained, &weights, replay);
    const double loss = lanes_.step(
        c_, s.pieces(), 1.0, router_bias_,
        [&](int64_t l, const double* sc, int64_t N) { bal_[size_t(l)]->accumulate(sc, N); }, s.trained(), s.weights(),
        s.replay());
    return sum_over_ranks(loss, /*gradients=*/true);
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
  // This rank's sequences of a step, with their masks, weights and routings: the caller's own vectors for one
  // process, copies of this rank's share under data parallelism.
  struct Share {
    const std::vector<std::vector<int32_t>>* all_pieces = nullptr;
    const std::vector<TokenMask>* all_trained = nullptr;
    const std::vector<TokenWeights>* all_weights = nullptr;
    const std::vector<RouterReplay>* all_replay = nullptr;
    bool split = false;
    std::vector<std::vector<int32_t>> own_pieces;
    std::vector<TokenMask> own_trained;
    std::vector<TokenWeights> own_weights;
    std::vector<RouterReplay> own_replay;
    const std::vector<std::vector<int32_t>>& pieces() const { return split ? own_pieces : *all_pieces; }
    const std::vector<TokenMask>* trained() const { return split && all_trained ? &own_trained : all_trained; }
    const std::vector<TokenWeights>* weights() const { return split && all_weights ? &own_weights : all_weights; }
    const std::vector<RouterReplay>* replay() const { return split && all_replay ? &own_replay : all_replay; }
  };
  Share share(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained,
              const std::vector<TokenWeights>* weights, const std::vector<RouterReplay>* replay) const {
    Share s;
    s.all_pieces = &pieces;
    s.all_trained = trained;
    s.all_weights = weights;
    s.all_replay = replay;
    if (!group_) return s;
    check_per_token(pieces, trained);
    check_per_token(pieces, weights);
    check_replay_count(pieces, replay);
    s.split = true;
    const std::vector<int64_t> rank_of = assign_lanes(pieces, group_->size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (rank_of[i] != group_->rank()) continue;
      s.own_pieces.push_back(pieces[i]);
      if (trained) s.own_trained.push_back((*trained)[i]);
      if (weights) s.own_weights.push_back((*weights)[i]);
      if (replay) s.own_replay.push_back((*replay)[i]);
    }
    return s;
  }
  // A rank's loss summed over the ranks; with `gradients`, P's gradients too.
  double sum_over_ranks(double loss, bool gradients) {
    if (!group_) return loss;
    if (gradients) group_->all_reduce_sum_buckets(P_.grads().data(), int64_t(P_.grads().size()), kGradientBucket);
    group_->all_reduce_sum(&loss, 1);
    return loss;
  }

  ParamStore& P_;
  const K3Config& c_;
  Optimizer& optimizer_;
  std::vector<std::unique_ptr<QuantileBalancer>> bal_;
  GradLanes lanes_;
  std::function<const double*(int64_t)> router_bias_;
  dist::Group* group_;  // null: one process
};

}  // namespace

std::unique_ptr<TrainDevice> make_cpu_train_device(ParamStore& P, const K3Config& c, Optimizer& optimizer,
                                                   const BalanceOptions& balance, int64_t lanes, dist::Group* group) {
  return std::make_unique<CpuTrainDevice>(P, c, optimizer, balance, lanes, group);
}

}  // namespace k3::train
