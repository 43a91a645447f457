#include "model/placement.h"

#include <algorithm>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"
#include "model/expert_parallel.h"
#include "model/tensor_table.h"
#include "model/vision_config.h"

namespace k3 {

StoredBytes stored_bytes(const K3Config& c, const std::string& config_path) {
  StoredBytes b;
  const TensorTable table(c);
  int64_t expert_tensors = 0;
  for (const TensorEntry& e : table.entries()) {
    const TensorInfo& info = e.info();
    b.tensors += info.component == ParamComponent::RoutedExperts && c.experts_mxfp4 ? 2 : 1;
    if (info.component == ParamComponent::RoutedExperts) {
      const int64_t rows = e.shape[0], cols = e.numel() / e.shape[0];
      const uint64_t bytes = c.experts_mxfp4 ? uint64_t(rows * (cols / 2 + cols / 32)) : uint64_t(e.numel()) * 2;
      if (e.expert == 0 && b.experts == 0) b.expert += bytes;  // one expert's three matrices
      if (++expert_tensors % 3 == 0) ++b.experts;
      continue;
    }
    const uint64_t bytes = uint64_t(e.params) * dtype_size(info.dtype);
    b.trunk += bytes;
    if (info.component == ParamComponent::Embedding && !c.tie_word_embeddings) b.embedding += bytes;
  }
  if (c.has_vision_config)
    for (const VisionTensorEntry& v : vision_tensor_table(load_vision_config(config_path))) {
      int64_t n = 1;
      for (int64_t d : v.shape) n *= d;
      b.vision += uint64_t(n) * 2;  // BF16
      ++b.tensors;
    }
  return b;
}

Placement plan_placement(const K3Config& c, const std::string& config_path, const PlacementOptions& o) {
  if (o.gpus < 1) fail("--gpus must be at least 1, got ", o.gpus);
  Placement p;
  p.bytes = stored_bytes(c, config_path);
  const int G = int(o.gpus);
  p.trunk_per_gpu = (p.bytes.trunk + uint64_t(G) - 1) / uint64_t(G);
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.is_moe_layer(l) ? 1 : 0;
  // The largest block one rank owns, over every MoE layer.
  int64_t block = 0;
  for (int q = 0; q < G; ++q)
    block = std::max(block, expert_first(q + 1, c.num_experts, G) - expert_first(q, c.num_experts, G));
  p.experts_per_rank = block * moe_layers;
  auto fit = [&](uint64_t used) -> int64_t {
    if (p.bytes.expert == 0) return 0;
    const uint64_t room = o.gpu_bytes > used + o.reserve_bytes ? o.gpu_bytes - used - o.reserve_bytes : 0;
    return int64_t(room / p.bytes.expert);
  };
  p.experts_on_gpu = std::min(p.experts_per_rank, fit(p.trunk_per_gpu));
  p.experts_on_gpu_replicated = std::min(p.experts_per_rank, fit(p.bytes.trunk));
  p.host_bytes_per_rank = uint64_t(p.experts_per_rank - p.experts_on_gpu) * p.bytes.expert;
  p.resident_fraction = p.experts_per_rank > 0 ? double(p.experts_on_gpu) / double(p.experts_per_rank) : 1.0;
  const uint64_t active_experts = uint64_t(c.num_experts_per_token * moe_layers) * p.bytes.expert;
  p.decode_bytes = p.bytes.trunk - p.bytes.embedding + active_experts;
  const double hbm = double(p.decode_bytes) / (double(G) * o.hbm_bytes_per_s);
  const double host = double(active_experts) * (1.0 - p.resident_fraction) / (double(G) * o.pcie_bytes_per_s);
  p.hbm_ceiling = 1.0 / hbm;
  p.pcie_ceiling = host > 0 ? 1.0 / host : std::numeric_limits<double>::infinity();
  return p;
}

}  // namespace k3
