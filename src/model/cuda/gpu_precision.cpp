// GpuPrecision names (cuda_model.h), in every build: the CLI parses --precision without a GPU.
#include "core/error.h"
#include "model/cuda/cuda_model.h"

namespace k3 {

const char* gpu_precision_name(GpuPrecision p) { return p == GpuPrecision::BF16 ? "bf16" : "f32"; }

GpuPrecision parse_gpu_precision(const std::string& s, const char* what) {
  if (s == "bf16") return GpuPrecision::BF16;
  if (s == "f32") return GpuPrecision::F32;
  fail(what, ": expected bf16 or f32, got '", s, "'");
}

}  // namespace k3
