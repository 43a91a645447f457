// The common part of a GPU bench's main, after its flags are parsed: --reps must be >= 1 (else exit 2);
// without a GPU it prints why and exits 0; otherwise it prints the device and runs `body`, and a
// k3::Error from it is printed and exits 1. `name` (the bench's) starts every message but the first.
#pragma once
#include <cstdio>
#include <string>

#include "core/cuda.h"   // defines: cuda::available, cuda::device_summary
#include "core/error.h"  // defines: k3::Error

namespace k3bench {

template <class Body>
int run_gpu_bench(const char* name, int reps, Body body) {
  if (reps < 1) {
    std::fprintf(stderr, "error: --reps must be >= 1, got %d\n", reps);
    return 2;
  }
  std::string why;
  if (!k3::cuda::available(&why)) {
    std::printf("%s: no GPU to run on (%s); nothing measured\n", name, why.c_str());
    return 0;
  }
  try {
    std::printf("%s: %s\n", name, k3::cuda::device_summary().c_str());
    body();
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
  return 0;
}

}  // namespace k3bench
