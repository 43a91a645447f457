// GPU tests: skip (not fail) when this build has no CUDA backend or the machine has no Hopper GPU,
// so CI (nvcc present, no GPU) compiles every CUDA kernel and still passes.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "core/cuda.h"

#define K3_REQUIRE_GPU()                                           \
  do {                                                             \
    std::string k3_why_;                                           \
    if (!::k3::cuda::available(&k3_why_)) GTEST_SKIP() << k3_why_; \
  } while (0)
