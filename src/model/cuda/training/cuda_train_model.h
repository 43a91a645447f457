// The K3 text model for training on one NVIDIA Hopper GPU: the CUDA twin of
// model/training/model_train.h. The same decoder schedule (model/decoder.h) runs its forward and its
// backward over a GPU backend whose every op has a CUDA forward and backward beside it (kernels/).
//
// A step's sequences run as one packed batch (rows = their total length; attention, the KDA
// recurrence and the short convolutions never cross a sequence boundary), so the projections are
// GEMMs over all the step's tokens. Parameters live on the device as fp32 master values and fp32
// gradients in the ParamStore's flat layout (a checkpoint is the host ParamStore written back); the
// optimizer and the balancer work on those buffers in place (train/optimizer_cuda.h,
// train/quantile_balance_cuda.h).
//
// Precisions: GpuPrecision::F32 (everything fp32, GEMMs pedantic fp32: the parity mode) and
// GpuPrecision::BF16 (bf16 GEMM operands on tensor cores, fp32 accumulation; everything else fp32).
// Not thread-safe; one model, one caller, the default stream.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/cuda/cuda_model.h"
#include "model/params.h"
#include "model/training/image_text_train.h"
#include "model/training/model_train.h"
#include "model/vision_config.h"

namespace k3::gemm::cuda {
class GemmContext;
}

namespace k3 {

// Empty when the GPU training kernels can train a model of this config, else what they cannot take
// (config fields named). CudaTrainModel::create refuses such a config up front; usable without a GPU.
std::string gpu_train_config_problem(const K3Config& c);

struct GpuStepHooks {
  // The selection-only router bias of a MoE layer: device fp32 [E]. Default: the model's
  // e_score_correction_bias.
  std::function<const float*(int64_t layer)> router_bias;
  // Every MoE layer's unbiased router scores of the step: device fp32 [rows, E] (valid during the call).
  std::function<void(int64_t layer, const float* scores, int64_t rows)> on_router_scores;
  // Router replay: the experts each row of the step's packed batch uses in MoE layer `layer`, device [rows, K]
  // in selection order, each in [0, E), instead of the router's own selection (no function, or null: it selects).
  std::function<const int32_t*(int64_t layer)> router_replay;
};

// Rows of a step's input that come from given device vectors, not the token table (the GPU form of
// train::TrainInputRows, model/training/model_train.h): positions [at, at + n) of piece `piece` take data
// [n, hidden] (an image's projected tokens; the ids there hold the placeholder). Those positions predict nothing
// from the position before them and give the token table no gradient; grad (optional, device [n, hidden]) is
// OVERWRITTEN by a backward with grad_scale × ∂loss/∂data.
struct GpuInputRows {
  int64_t piece = 0, at = 0, n = 0;
  const float* data = nullptr;
  float* grad = nullptr;
};

class CudaTrainModel {
 public:
  // P gives the tensors' names, shapes, layout and initial values; it must outlive the model (its
  // values are only read again by upload()). Throws k3::Error when the build has no CUDA backend, no
  // Hopper GPU is visible, or the config is one the GPU kernels cannot take.
  static std::unique_ptr<CudaTrainModel> create(const K3Config& c, const train::ParamStore& P, GpuPrecision precision);
  ~CudaTrainModel();
  CudaTrainModel(const CudaTrainModel&) = delete;
  CudaTrainModel& operator=(const CudaTrainModel&) = delete;

  const K3Config& config() const;
  GpuPrecision precision() const;

  // Σ over `pieces` of the summed next-token cross-entropy (piece: positions 0..T-1, ids[t+1] the
  // target of t), as train::sequence_loss summed over the pieces. With `backward`, grad_scale × its
  // gradient is ADDED to the device gradient buffer. Waits for the GPU (the loss comes to the host).
  // token_losses (optional): each piece's per-position losses −log p(ids[t+1]) for t < T−1, the
  // log-probabilities a policy-gradient step needs, computed in this same pass.
  // input_rows (optional): spans of the pieces that take given rows (GpuInputRows; inside their piece, not
  // overlapping: a k3::Error names one that is not). The loss then sums the positions whose target is a token.
  // trained (optional): each piece's trained tokens (train::TokenMask, model/training/model_train.h); the loss
  // then sums the positions whose target is a trained token. weights (optional): each piece's token weights
  // (train::TokenWeights, rounded to fp32): the loss and its gradient weigh each token's term, as sequence_loss.
  // A step with input rows, masks or weights keeps no token_losses (a k3::Error when both are asked for).
  double loss(const std::vector<std::vector<int32_t>>& pieces, bool backward, double grad_scale,
              const GpuStepHooks* hooks = nullptr, std::vector<std::vector<double>>* token_losses = nullptr,
              const std::vector<GpuInputRows>* input_rows = nullptr,
              const std::vector<train::TokenMask>* trained = nullptr,
              const std::vector<train::TokenWeights>* weights = nullptr);

  // The GPU twin of train::image_text_loss (model/training/image_text_train.h) over a step of sequences: the
  // tower and projector of vc (model/cuda/training/vision_train.cpp) encode every image of the step in one packed
  // pass, their projected tokens go in as input rows, and with `backward` the text loss's gradient flows back
  // through them into the tower: grad_scale × the gradient of the summed loss is ADDED to every text and vision
  // tensor's device gradient. The parameters must hold the vision tensors (the ParamStore the model was made
  // from). Returns the summed loss; *targets (optional) receives how many positions it sums. Not in the
  // batch-invariant mode (a k3::Error): the tower's GEMMs run on cuBLAS.
  double image_text_loss(const std::vector<train::ImageTextSequence>& seqs, const VisionConfig& vc, bool backward,
                         double grad_scale, const GpuStepHooks* hooks = nullptr, int64_t* targets = nullptr);

  // The device parameters: fp32 values and gradients in P's flat layout (P.offset(name)).
  float* values_device();
  float* grads_device();
  int64_t numel() const;
  void zero_grads();
  // After the values changed on the device (an optimizer step): the BF16 mode's bf16 weight copy.
  void values_changed();
  void upload(const train::ParamStore& P);           // values from the host
  void download_values(train::ParamStore& P) const;  // values to the host (checkpoints)
  void download_grads(train::ParamStore& P) const;   // gradients to the host (tests)
  gemm::cuda::GemmContext& gemm();
  // Activation recomputation: for each layer flagged, the attention and FFN blocks keep only their
  // outputs through the forward and run again in the backward (the AttnRes + norm inputs and the
  // block sums are kept). Same results bit for bit; the memory of those blocks' tapes is freed.
  // Empty (the default): nothing recomputed. One flag per layer.
  void set_recompute(const std::vector<bool>& layers);
  // Batch-invariant mode (BF16 only; throws k3::Error otherwise): every GEMM runs on fixed-tile
  // kernels whose result for a row does not depend on the other rows (the grouped expert GEMM with one
  // expert for the dense projections and the lm_head, always the grouped GEMMs for the routed
  // experts), and the head's vocabulary chunks have a fixed size. A sequence's losses are then the
  // same bits whatever else the step holds and however many sequences it has: what reinforcement
  // learning needs of the rollout's and the trainer's log-probabilities. Slower (the dense GEMMs leave
  // cuBLAS); needs every weight on the kernel's grid (dimensions multiples of 8, 16-byte aligned in
  // the flat layout: k3::Error at the first step otherwise).
  void set_batch_invariant(bool on);
  bool batch_invariant() const;
  size_t parameter_bytes() const;  // device memory of values, gradients and the bf16 copy
  // The MoE layers that ran so far whose routed experts can run as grouped GEMMs (BF16 mode, expert
  // tensors 16-byte aligned in the flat layout); the rest run one cuBLAS call per expert, as every
  // layer does in a pass of 1,024 or more rows per expert on average (ffn_train.cpp).
  int64_t grouped_expert_layers() const;

  struct Impl;

 private:
  CudaTrainModel();
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3
