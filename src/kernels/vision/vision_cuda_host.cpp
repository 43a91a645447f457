// The host-side parts of kernels/vision/vision_cuda.h that need no GPU (built with or without the CUDA backend):
// the packed width the attention kernels take, the RoPE table, the attention kernels' names.
#include <cmath>

#include "core/error.h"
#include "kernels/vision/vision_cuda.h"

namespace k3::vision::cuda {

int64_t packed_width(int64_t hd) {
  if (hd <= 0) return 0;
  for (int64_t w : {int64_t(32), int64_t(64), int64_t(128)})
    if (hd <= w) return w;
  return 0;
}

std::vector<float> rope_table(int64_t hd, int64_t positions) {
  K3_CHECK(hd > 0 && hd % 4 == 0, "vision rope_table: the head dim ", hd, " must be a positive multiple of 4");
  K3_CHECK(positions > 0, "vision rope_table: positions must be positive, got ", positions);
  const int64_t nf = hd / 4;
  std::vector<float> t(size_t(positions * nf * 2));
  for (int64_t i = 0; i < nf; ++i) {
    // The CPU's frequency (kernels/vision/vision_cpu.cpp: rope2d_forward) and angle, in double.
    const double f = 1.0 / std::pow(10000.0, double(4 * i) / double(hd));
    for (int64_t p = 0; p < positions; ++p) {
      const double a = double(p) * f;
      t[size_t((p * nf + i) * 2)] = float(std::cos(a));
      t[size_t((p * nf + i) * 2 + 1)] = float(std::sin(a));
    }
  }
  return t;
}

const char* attn_kernel_name(AttnKernel k) {
  switch (k) {
    case AttnKernel::kMmaSync: return "mma";
    case AttnKernel::kWgmma: return "wgmma";
    default: return "auto";
  }
}

AttnKernel parse_attn_kernel(const std::string& s, const char* what) {
  if (s == "auto") return AttnKernel::kAuto;
  if (s == "mma") return AttnKernel::kMmaSync;
  if (s == "wgmma") return AttnKernel::kWgmma;
  fail(what, ": expected auto, mma or wgmma, got '", s, "'");
}

}  // namespace k3::vision::cuda
