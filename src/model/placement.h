// Where a model's weights go on G GPUs with experts beyond their memory in host RAM: the plan `k3 inspect
// --gpus` prints, and the arithmetic behind docs/BENCHMARKS.md's "what the release needs".
//
// Bytes are as the checkpoint stores them (the tensor table's dtypes; routed experts MXFP4 when the config's
// quantization_config says so: per [rows, cols] matrix rows·cols/2 packed bytes plus rows·cols/32 scale bytes).
//
// The layout planned: the trunk (every text tensor but the routed experts: attention, dense and shared FFNs,
// router and latent projections, norms, embedding and head) split evenly over the G GPUs, as tensor
// parallelism splits it; the routed experts split by expert parallelism (rank q owns its contiguous block of
// each layer's experts, model/expert_parallel.h); on each GPU, after its trunk share and `reserve` bytes for
// caches, activations and workspaces, as many of its own experts as fit; the rest in pinned host memory, read on
// demand through an LRU. The replicated-trunk figure says why the trunk cannot simply be copied to every GPU.
//
// Decode at batch 1 is bandwidth-bound. Per token every trunk matrix but the embedding is read once (split over
// the GPUs) and top-k experts per MoE layer; with routing spread evenly, the share of those experts that sit in
// host memory crosses PCIe. hbm_ceiling and pcie_ceiling are the tokens/s those two transfers alone would allow.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"

namespace k3 {

struct StoredBytes {
  uint64_t trunk = 0;      // text tensors other than the routed experts
  uint64_t embedding = 0;  // of which the input embedding (a row gather per token, not read whole)
  uint64_t expert = 0;     // one routed expert (w1, w2, w3)
  int64_t experts = 0;     // routed experts in the model (MoE layers × num_experts)
  uint64_t vision = 0;     // vision tower and projector (0 without a vision_config)
  int64_t tensors = 0;     // stored tensors (an MXFP4 matrix is two: packed values and scales)
  uint64_t total() const { return trunk + uint64_t(experts) * expert + vision; }
};
// config_path: for the vision tower's sizes (K3Config does not keep them).
StoredBytes stored_bytes(const K3Config& c, const std::string& config_path);

struct PlacementOptions {
  int64_t gpus = 8;
  uint64_t gpu_bytes = uint64_t(139) << 30;     // H200: 141 GB of HBM3e, ~139 GiB usable (as the lent ones report)
  uint64_t reserve_bytes = uint64_t(16) << 30;  // per GPU: caches, activations, workspaces
  double hbm_bytes_per_s = 4.8e12;              // per GPU
  double pcie_bytes_per_s = 55e9;               // host to GPU, per GPU (PCIe Gen5 x16, achieved)
};

struct Placement {
  StoredBytes bytes;
  uint64_t trunk_per_gpu = 0;
  int64_t experts_per_rank = 0;              // owned (the largest block)
  int64_t experts_on_gpu = 0;                // of those, resident in HBM
  uint64_t host_bytes_per_rank = 0;          // pinned host memory for the rest
  double resident_fraction = 0;              // experts_on_gpu / experts_per_rank
  int64_t experts_on_gpu_replicated = 0;     // per GPU, were the whole trunk on every GPU (can be 0)
  uint64_t decode_bytes = 0;                 // read per token at batch 1
  double hbm_ceiling = 0, pcie_ceiling = 0;  // tokens/s
};
Placement plan_placement(const K3Config& c, const std::string& config_path, const PlacementOptions& o);

}  // namespace k3
