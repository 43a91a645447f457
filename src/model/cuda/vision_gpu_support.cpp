// What the GPU vision tower can take, in every build (no CUDA needed), so that a config its kernels cannot run is
// refused at load with the field named, and so CI can test it.
#include <string>

#include "kernels/vision/vision_cuda.h"
#include "model/cuda/vision_cuda.h"

namespace k3 {

std::string gpu_vision_config_problem(const VisionConfig& c) {
  constexpr int64_t kNormMaxWidth = 16384;  // kernels/norm/norm_cuda.h: a row in one block's registers
  std::string why;
  auto need = [&](bool ok, const std::string& what) {
    if (ok) return;
    if (!why.empty()) why += "; ";
    why += what;
  };
  need(vision::cuda::packed_width(c.head_dim()) > 0,
       "vision_config.qkv_hidden_size / vt_num_attention_heads = " + std::to_string(c.head_dim()) +
           ": the GPU attention kernels take head dims up to 128");
  need(c.hidden_size <= kNormMaxWidth, "vision_config.vt_hidden_size = " + std::to_string(c.hidden_size) +
                                           ": the GPU RMSNorm takes rows of at most 16384");
  need(c.text_hidden_size <= kNormMaxWidth, "vision_config.text_hidden_size = " + std::to_string(c.text_hidden_size) +
                                                ": the GPU RMSNorm takes rows of at most 16384");
  return why;
}

}  // namespace k3
