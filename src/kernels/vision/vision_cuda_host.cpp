// The host-side parts of kernels/vision/vision_cuda.h that need no GPU (built with or without the CUDA backend):
// the packed width the attention kernels take, the RoPE table, the attention kernels' names, and the transposed
// resize taps of the training kernels (vision_train_cuda.h).
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/vision/bilinear_taps.h"
#include "kernels/vision/vision_cuda.h"
#include "kernels/vision/vision_train_cuda.h"

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

TransposedTaps transposed_taps(int64_t n_out, int64_t n_in) {
  K3_CHECK(n_out > 0 && n_in > 0 && n_out < INT32_MAX / 2, "vision transposed_taps: sizes ", n_out, " and ", n_in,
           " must be positive (and below 2^30)");
  const std::vector<vision_detail::BilinearTap> taps = vision_detail::bilinear_taps(n_out, n_in);
  std::vector<std::vector<std::pair<int32_t, double>>> by_source(static_cast<size_t>(n_in));
  for (int64_t i = 0; i < n_out; ++i) {  // ascending output index; i0 == i1 at the last row gives one tap of 1
    const vision_detail::BilinearTap& t = taps[size_t(i)];
    if (t.i0 == t.i1) {
      by_source[size_t(t.i0)].push_back({int32_t(i), 1.0});
      continue;
    }
    if (1.0 - t.frac != 0.0) by_source[size_t(t.i0)].push_back({int32_t(i), 1.0 - t.frac});
    if (t.frac != 0.0) by_source[size_t(t.i1)].push_back({int32_t(i), t.frac});
  }
  TransposedTaps out;
  out.start.push_back(0);
  for (const auto& list : by_source) {
    for (const auto& [i, w] : list) out.index.push_back(i), out.weight.push_back(w);
    out.start.push_back(int32_t(out.index.size()));
  }
  return out;
}

}  // namespace k3::vision::cuda
