// The GPU trainer behind train_device.h: the model (model/cuda/training), the optimizer, clipping and
// the balancers all on the device. Per step the host reads back only the metrics line's numbers: the
// loss, the gradient norm with the count of non-finite gradients, and each balancer's MaxVio.
#include "core/error.h"
#include "train/train_device.h"

#ifdef K3_HAVE_CUDA
#include "core/cuda.h"
#include "model/cuda/training/cuda_train_model.h"
#include "train/optimizer_cuda.h"
#include "train/quantile_balance_cuda.h"

namespace k3::train {
namespace {

class CudaTrainDevice final : public TrainDevice {
 public:
  CudaTrainDevice(ParamStore& P, const K3Config& c, const Optimizer& optimizer, const BalanceOptions& balance,
                  const CudaTrainOptions& options)
      : P_(P),
        c_(c),
        opt_(options),
        model_(CudaTrainModel::create(c, P, options.precision)),
        optimizer_(optimizer, P, model_->values_device(), model_->grads_device(), model_->gemm(),
                   options.precision == GpuPrecision::BF16),
        norm_(1),
        nonfinite_(1),
        workspace_(clip_grad_norm_workspace_bytes(model_->numel())) {
    const std::vector<std::vector<double>> bias = router_biases(P, c);
    bal_.resize(bias.size());
    for (size_t l = 0; l < bias.size(); ++l)
      if (!bias[l].empty())
        bal_[l] = std::make_unique<CudaQuantileBalancer>(c.num_experts, c.num_experts_per_token, balance, bias[l]);
    hooks_.router_bias = [this](int64_t l) { return bal_[size_t(l)]->bias_device(); };
    if (options.recompute) model_->set_recompute(std::vector<bool>(size_t(c.num_hidden_layers), true));
    if (options.batch_invariant) model_->set_batch_invariant(true);
  }

  std::string describe() const override {
    std::string d = std::string("cuda (") + gpu_precision_name(model_->precision());
    if (opt_.recompute) d += ", activations recomputed";
    if (opt_.batch_invariant) d += ", batch-invariant";
    if (opt_.micro_batch_tokens > 0) d += ", micro-batches of " + std::to_string(opt_.micro_batch_tokens) + " tokens";
    return d + ", " + cuda::device_summary() + ")";
  }

  // Every micro-batch adds its gradient to the buffer and its router scores to the balancers.
  double gradients(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained,
                   double grad_scale) override {
    model_->zero_grads();
    GpuStepHooks hooks = hooks_;
    hooks.on_router_scores = [this](int64_t l, const float* s, int64_t N) { bal_[size_t(l)]->accumulate(s, N); };
    return over_micro_batches(pieces, trained, [&](const auto& mb, const auto* mt) {
      return model_->loss(mb, true, grad_scale, &hooks, nullptr, nullptr, mt);
    });
  }

  double clip(double max_norm, std::string* bad) override {
    clip_grad_norm_cuda(model_->grads_device(), model_->numel(), max_norm, norm_.data(), nonfinite_.data(),
                        workspace_.data());
    double norm = 0;
    int64_t nonfinite = 0;
    cuda::copy_to_host(&norm, norm_.data(), sizeof(double));
    cuda::copy_to_host(&nonfinite, nonfinite_.data(), sizeof(int64_t));
    bad->clear();
    if (nonfinite > 0) {  // rare: name the tensor from a host copy
      model_->download_grads(P_);
      *bad = first_nonfinite_tensor(P_, /*gradients=*/true);
      if (bad->empty()) *bad = std::to_string(nonfinite) + " gradient entries";
    }
    return norm;
  }

  std::vector<double> finish_balance() override {
    std::vector<double> maxvio;
    for (auto& b : bal_)
      if (b) {
        b->finish_step();
        maxvio.push_back(b->last_max_vio());
      }
    return maxvio;
  }

  std::string update(double lr) override {
    optimizer_.step(lr);
    model_->values_changed();
    // The update itself can overflow: count non-finite values (the norm routine, no clipping).
    clip_grad_norm_cuda(model_->values_device(), model_->numel(), 0.0, norm_.data(), nonfinite_.data(),
                        workspace_.data());
    int64_t nonfinite = 0;
    cuda::copy_to_host(&nonfinite, nonfinite_.data(), sizeof(int64_t));
    if (nonfinite == 0) return {};
    model_->download_values(P_);
    const std::string bad = first_nonfinite_tensor(P_, /*gradients=*/false);
    return bad.empty() ? std::to_string(nonfinite) + " parameter entries" : bad;
  }

  double forward_loss(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained) override {
    return over_micro_batches(pieces, trained, [&](const auto& mb, const auto* mt) {
      return model_->loss(mb, false, 0.0, &hooks_, nullptr, nullptr, mt);
    });
  }

  std::vector<std::vector<double>> token_logprobs(const std::vector<std::vector<int32_t>>& pieces,
                                                  const std::vector<RouterReplay>* replay,
                                                  std::vector<RouterReplay>* topk) override {
    if (topk)
      fail("the GPU trainer does not report its own routing; compare routings on the CPU trainer, or replay them");
    std::vector<std::vector<double>> out;
    for (const auto& [begin, end] : micro_batches(pieces, opt_.micro_batch_tokens)) {
      const std::vector<std::vector<int32_t>> mb(pieces.begin() + std::ptrdiff_t(begin),
                                                 pieces.begin() + std::ptrdiff_t(end));
      std::vector<std::vector<double>> losses;
      GpuStepHooks hooks = hooks_;
      if (replay) hooks.router_replay = upload_replay(*replay, pieces, begin, end);
      model_->loss(mb, false, 0.0, &hooks, &losses);
      for (size_t i = 0; i < mb.size(); ++i) {
        std::vector<double> lp(mb[i].size(), 0.0);
        for (size_t t = 1; t < lp.size(); ++t) lp[t] = -losses[i][t - 1];
        out.push_back(std::move(lp));
      }
    }
    return out;
  }

  double weighted_gradients(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>& trained,
                            const std::vector<TokenWeights>& weights,
                            const std::vector<RouterReplay>* replay) override {
    check_per_token(pieces, &trained);
    check_per_token(pieces, &weights);
    model_->zero_grads();
    GpuStepHooks hooks = hooks_;
    hooks.on_router_scores = [this](int64_t l, const float* s, int64_t N) { bal_[size_t(l)]->accumulate(s, N); };
    double loss = 0;
    for (const auto& [begin, end] : micro_batches(pieces, opt_.micro_batch_tokens)) {
      const auto b = std::ptrdiff_t(begin), e = std::ptrdiff_t(end);
      const std::vector<std::vector<int32_t>> mb(pieces.begin() + b, pieces.begin() + e);
      const std::vector<TokenMask> mt(trained.begin() + b, trained.begin() + e);
      const std::vector<TokenWeights> mw(weights.begin() + b, weights.begin() + e);
      if (replay) hooks.router_replay = upload_replay(*replay, pieces, begin, end);
      loss += model_->loss(mb, true, 1.0, &hooks, nullptr, nullptr, &mt, &mw);
    }
    return loss;
  }

  void store_values(ParamStore& P) override {
    K3_CHECK(&P == &P_, "CudaTrainDevice: another parameter store");
    model_->download_values(P);
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
      if (bal_[size_t(l)])
        bal_[size_t(l)] =
            std::make_unique<CudaQuantileBalancer>(CudaQuantileBalancer::from_json(balancers.at(std::to_string(l))));
  }

 private:
  // Router replay's experts for pieces [begin, end) in the packed batch's row order (each MoE layer: the pieces'
  // [T, K] rows one after another), on the device until the next call; the hook that hands them to the model.
  std::function<const int32_t*(int64_t)> upload_replay(const std::vector<RouterReplay>& replay,
                                                       const std::vector<std::vector<int32_t>>& pieces, size_t begin,
                                                       size_t end) {
    K3_CHECK(replay.size() == pieces.size(), "router replay: ", replay.size(), " routings for ", pieces.size(),
             " sequences");
    const int64_t E = c_.num_experts;
    for (size_t i = begin; i < end; ++i) {
      replay_hook(replay[i], c_, int64_t(pieces[i].size()));  // the shapes, with a named error
      for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
        for (const int32_t e : replay[i][size_t(l)])
          if (e < 0 || e >= E)
            fail("router replay: expert ", e, " of sequence ", i, ", layer ", l, " is not in 0..", E - 1);
    }
    replay_.clear();
    replay_.resize(size_t(c_.num_hidden_layers));
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      if (!c_.is_moe_layer(l)) continue;
      std::vector<int32_t> rows;
      for (size_t i = begin; i < end; ++i)
        rows.insert(rows.end(), replay[i][size_t(l)].begin(), replay[i][size_t(l)].end());
      if (!rows.empty()) replay_[size_t(l)] = cuda::DeviceBuffer<int32_t>(rows.data(), rows.size());
    }
    return [this](int64_t l) { return replay_[size_t(l)].size() ? replay_[size_t(l)].data() : nullptr; };
  }

  // Σ of f(pieces, trained) over the micro-batches of `pieces` and their masks (the losses summed on the host in
  // micro-batch order).
  template <class F>
  double over_micro_batches(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained,
                            F&& f) {
    check_per_token(pieces, trained);
    const auto runs = micro_batches(pieces, opt_.micro_batch_tokens);
    if (runs.size() == 1) return f(pieces, trained);
    double loss = 0;
    for (const auto& [begin, end] : runs) {
      const auto b = std::ptrdiff_t(begin), e = std::ptrdiff_t(end);
      const std::vector<TokenMask> masks =
          trained ? std::vector<TokenMask>(trained->begin() + b, trained->begin() + e) : std::vector<TokenMask>{};
      loss += f(std::vector<std::vector<int32_t>>(pieces.begin() + b, pieces.begin() + e), trained ? &masks : nullptr);
    }
    return loss;
  }

  ParamStore& P_;
  const K3Config& c_;
  CudaTrainOptions opt_;
  std::unique_ptr<CudaTrainModel> model_;
  CudaOptimizer optimizer_;
  std::vector<std::unique_ptr<CudaQuantileBalancer>> bal_;
  GpuStepHooks hooks_;
  cuda::DeviceBuffer<double> norm_;
  cuda::DeviceBuffer<int64_t> nonfinite_;
  cuda::DeviceBuffer<uint8_t> workspace_;
  std::vector<cuda::DeviceBuffer<int32_t>> replay_;  // upload_replay's experts, per layer
};

}  // namespace

std::unique_ptr<TrainDevice> make_cuda_train_device(ParamStore& P, const K3Config& c, const Optimizer& optimizer,
                                                    const BalanceOptions& balance, const CudaTrainOptions& options) {
  if (options.micro_batch_tokens < 0) fail("GPU training: micro_batch_tokens must be >= 0");
  return std::make_unique<CudaTrainDevice>(P, c, optimizer, balance, options);
}

}  // namespace k3::train

#else  // no CUDA backend

namespace k3::train {
std::unique_ptr<TrainDevice> make_cuda_train_device(ParamStore&, const K3Config&, const Optimizer&,
                                                    const BalanceOptions&, const CudaTrainOptions&) {
  fail(
      "GPU training cannot start: this k3 was built without the CUDA backend (nvcc not found at build time, or "
      "-DK3_CUDA=OFF)");
}
}  // namespace k3::train

#endif  // K3_HAVE_CUDA
