// Where the trainer's steps run (train/trainer.h drives one of these): the CPU in float64 on gradient
// lanes, or one GPU in fp32 / bf16 mixed precision. The loop itself (data, schedule, clipping
// decisions, metrics, checkpoints) is the same for both; a device owns the gradients, the optimizer
// state and the router balancers while the run lasts, and moves them into the host ParamStore and
// the checkpoint's formats on save, so a checkpoint written by one device resumes on the other.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dist/group.h"
#include "model/config.h"
#include "model/cuda/cuda_model.h"
#include "model/params.h"
#include "model/training/model_train.h"
#include "train/optimizer.h"
#include "train/quantile_balance.h"

namespace k3::train {

class TrainDevice {
 public:
  virtual ~TrainDevice() = default;
  virtual std::string describe() const = 0;  // for the run's first line, e.g. "cpu (float64, 2 lanes)"

  // Zeroes the gradients, then adds grad_scale × the gradient of the summed loss of `pieces`;
  // returns that summed loss. Every MoE layer's router scores go to its balancer. `trained` (null: every
  // token): each piece's trained tokens (model/training/model_train.h).
  virtual double gradients(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained,
                           double grad_scale) = 0;
  // The pre-clip global gradient norm; when max_norm > 0 and the norm exceeds it, the gradients are
  // scaled to max_norm. `bad` receives "" or where the first non-finite gradient is.
  virtual double clip(double max_norm, std::string* bad) = 0;
  // Ends the balancers' step: each MoE layer's MaxVio (layer order), the next biases in effect.
  virtual std::vector<double> finish_balance() = 0;
  // One optimizer update at `lr`; returns "" or the first parameter it made non-finite.
  virtual std::string update(double lr) = 0;
  // Summed loss of `pieces` with the current parameters and biases; no gradient, nothing balanced.
  virtual double forward_loss(const std::vector<std::vector<int32_t>>& pieces,
                              const std::vector<TokenMask>* trained) = 0;

  // Policy-gradient steps (`k3 rl`, train/policy_gradient.h). log π(ids[t]) of every token after the first of each
  // piece ([T] per piece, entry 0 is 0) with the current parameters and biases; nothing balanced. `replay`
  // (optional): each piece's routing (router replay); `topk` (optional) receives each piece's own routing (the CPU
  // trainer only: the GPU one refuses with a k3::Error).
  virtual std::vector<std::vector<double>> token_logprobs(const std::vector<std::vector<int32_t>>& pieces,
                                                          const std::vector<RouterReplay>* replay,
                                                          std::vector<RouterReplay>* topk) = 0;
  // gradients() of the weighted loss Σ_t weights[t] · (−log π(ids[t])) over each piece's trained tokens.
  virtual double weighted_gradients(const std::vector<std::vector<int32_t>>& pieces,
                                    const std::vector<TokenMask>& trained, const std::vector<TokenWeights>& weights,
                                    const std::vector<RouterReplay>* replay) = 0;

  // The values (and each balancer's bias, as e_score_correction_bias) into P: what a model directory of the
  // current parameters needs (an RL run's policy after each update).
  virtual void store_values(ParamStore& P) = 0;
  // Checkpoints: store_values, the optimizer state in the CPU optimizer's format, the balancers' JSON by layer.
  virtual void save_state(ParamStore& P, OptimizerState& optimizer, nlohmann::json& balancers) = 0;
  virtual void load_state(const OptimizerState& optimizer, const nlohmann::json& balancers) = 0;
};

// The float64 CPU trainer: P holds the parameters and gradients; `optimizer` is built on P; `lanes`
// gradient lanes (train/grad_lanes.h).
//
// Data parallelism (`group` of more than one rank, every rank given the same step): the step's sequences
// are dealt to the ranks as to gradient lanes (assign_lanes over the ranks), each rank runs its own share on
// its lanes, and the gradients are summed over the ranks in buckets of kGradientBucket values, the losses
// with them. Quantile Balancing pools every rank's statistics (QuantileBalancer::merge_ranks) and Muon's
// Newton–Schulz is shared out by layer (Optimizer::step), so every rank ends the step with the same values,
// optimizer state and biases: those of one process running the whole step, up to the order of the
// gradient sum. Log-probabilities (token_logprobs) are computed whole on every rank.
std::unique_ptr<TrainDevice> make_cpu_train_device(ParamStore& P, const K3Config& c, Optimizer& optimizer,
                                                   const BalanceOptions& balance, int64_t lanes,
                                                   dist::Group* group = nullptr);
// Values per all-reduce bucket of the data-parallel gradient sum (32 MiB of float64).
constexpr int64_t kGradientBucket = int64_t(1) << 22;

// How the GPU trainer runs a step.
struct CudaTrainOptions {
  GpuPrecision precision = GpuPrecision::BF16;
  // Recompute every layer's attention and FFN blocks in the backward (CudaTrainModel::set_recompute).
  bool recompute = false;
  // > 0: a step's sequences run in micro-batches of at most this many tokens (micro_batches), their
  // gradients summed on the device before the one update: gradient accumulation, for steps larger
  // than the activations of one pass can hold. 0: the whole step in one pass. The same step either
  // way, up to the order of the fp32 sums.
  int64_t micro_batch_tokens = 0;
  // Every GEMM on fixed tiles and the head's chunks fixed (CudaTrainModel::set_batch_invariant; bf16
  // only): a sequence's losses do not depend on what else the step holds.
  bool batch_invariant = false;
};

// The GPU trainer (train/cuda_train_device.cpp): P's values are uploaded, and `optimizer` (built on
// P) gives the update plan and the state format. Throws k3::Error when the build has no CUDA
// backend or there is no usable GPU.
std::unique_ptr<TrainDevice> make_cuda_train_device(ParamStore& P, const K3Config& c, const Optimizer& optimizer,
                                                    const BalanceOptions& balance, const CudaTrainOptions& options);

// The micro-batches of a step: consecutive runs [begin, end) of `pieces`, in order, each of at most
// max_tokens tokens, except that a piece longer than max_tokens is a micro-batch of its own.
// max_tokens <= 0: one run of every piece. No piece is split (attention and the KDA state never
// cross a micro-batch).
std::vector<std::pair<size_t, size_t>> micro_batches(const std::vector<std::vector<int32_t>>& pieces,
                                                     int64_t max_tokens);

// Each MoE layer's selection bias as P holds it (e_score_correction_bias), empty for the other layers:
// where a run's balancers start.
std::vector<std::vector<double>> router_biases(const ParamStore& P, const K3Config& c);
// A balancer's bias written back into P's e_score_correction_bias of layer l (checkpoints carry it).
void store_router_bias(ParamStore& P, const K3Config& c, int64_t layer, const std::vector<double>& bias);

}  // namespace k3::train
