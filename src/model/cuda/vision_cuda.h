// The vision tower and projector on one NVIDIA Hopper GPU, in bf16: the CUDA twin of model/vision.h
// (MoonViT-V2 + PatchMergerMLPV2, K3-ARCHITECTURE.md §8). Same inputs, outputs and trace points as
// VisionModel::encode; the same forward, composed from the text model's GEMMs and RMSNorm
// (kernels/gemm/linear_cuda.h, kernels/norm/norm_cuda.h) and the tower's own kernels
// (kernels/vision/vision_cuda.h):
//
//   x = bf16(patches) · Wpatchᵀ                      fp32 [L, width]; + position table resized per grid (+ time)
//   per block: y = bf16(RMSNorm0 x); qkv = y · Wqkvᵀ (fp32); q, k = RoPE2D (fp32 math) -> bf16 head-major;
//              o = attention per item (bf16, tensor cores); x += o · Woᵀ;
//              y = bf16(RMSNorm1 x); h = y · fc0ᵀ (fp32); x += bf16(gelu_tanh h) · fc1ᵀ
//   x = RMSNorm(x) (fp32); merged = mean over frames of 2 x 2 neighbours (fp32, and bf16 for the GEMM)
//   projected = RMSNorm(bf16(gelu_erf(merged · W1ᵀ)) · W2ᵀ, projector_ln_eps) (fp32)
//
// Precision (docs/CUDA.md, "The vision tower on the GPU", has the argument): bf16 weights and bf16 GEMM inputs
// with fp32 accumulation (the release runs the tower in bf16); the residual stream x in fp32, so 27 blocks of
// residual adds do not round to 8 bits each time; RMSNorm and softmax math in fp32 (the norms' eps is 2^-7, a
// fixed constant, as on the CPU); pre-activations and q/k/v kept in fp32 until their one rounding to bf16 after
// the GELU or RoPE; the outputs (merged, projected) fp32 like the CPU's.
//
// Weights are uploaded once, in any dtype the loaders take (F32, BF16, F16), rounded to bf16. Per-encode
// scratch grows to the largest encode seen and is kept. encode() may be called from several threads: calls
// take turns (a mutex), each on its calling thread's default stream.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "kernels/vision/vision_cuda.h"
#include "model/vision.h"

namespace k3 {

// Empty when the GPU path can run a tower of this config, else what it cannot take (fields named): a head dim
// over 128 (qkv_hidden_size / vt_num_attention_heads; the attention kernels' widest), a width or text width
// over the RMSNorm kernel's 16384. Usable without a GPU; CudaVisionModel refuses such a config up front.
std::string gpu_vision_config_problem(const VisionConfig& c);

class CudaVisionModel : public VisionEncoder {
 public:
  // dir: as VisionModel::load. Throws k3::Error when the build has no CUDA backend, no Hopper GPU is visible,
  // the config is one gpu_vision_config_problem refuses, or the weights do not fit.
  static std::unique_ptr<CudaVisionModel> load(const std::string& dir);
  // From a config and its checkpoint (what VisionModel holds): the same tensor names and checks.
  CudaVisionModel(const VisionConfig& c, const SafeTensors& st);
  ~CudaVisionModel() override;
  CudaVisionModel(const CudaVisionModel&) = delete;
  CudaVisionModel& operator=(const CudaVisionModel&) = delete;

  const VisionConfig& config() const override;
  std::string description() const override;
  size_t weight_bytes() const;   // device memory the weights take
  size_t scratch_bytes() const;  // device memory the per-encode scratch holds now

  std::vector<VisionItem> encode(const float* pixel_patches, int64_t patches, const std::vector<VisionGrid>& grids,
                                 const VisionTrace& trace = {}) const override;

  // For benchmarks: pixel_patches already on the device (fp32 [patches, 3 p p]); runs the tower and the projector
  // and leaves the outputs on the device (nothing is copied back, no trace); returns the merged tokens.
  int64_t encode_on_device(const float* device_pixel_patches, int64_t patches,
                           const std::vector<VisionGrid>& grids) const;
  // Which attention kernel the tower runs (the benchmark and the tests compare them); kAuto unless set.
  void set_attention_kernel(vision::cuda::AttnKernel k);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace k3
