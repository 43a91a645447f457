// For .cu files only: check a CUDA runtime / cuBLAS call and turn a failure into a k3::Error naming
// the call, where it was made, and CUDA's own message.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define K3_CUDA_CHECK(call)                                                                                      \
  do {                                                                                                           \
    const cudaError_t k3_err_ = (call);                                                                          \
    if (k3_err_ != cudaSuccess)                                                                                  \
      ::k3::fail("CUDA: ", #call, " failed at ", __FILE__, ":", __LINE__, ": ", cudaGetErrorName(k3_err_), " (", \
                 cudaGetErrorString(k3_err_), ")");                                                              \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, execution errors at the next sync.
#define K3_CUDA_LAUNCH_CHECK() K3_CUDA_CHECK(cudaGetLastError())

#define K3_CUBLAS_CHECK(call)                                                                                        \
  do {                                                                                                               \
    const cublasStatus_t k3_st_ = (call);                                                                            \
    if (k3_st_ != CUBLAS_STATUS_SUCCESS)                                                                             \
      ::k3::fail("cuBLAS: ", #call, " failed at ", __FILE__, ":", __LINE__, ": ", cublasGetStatusName(k3_st_), " (", \
                 cublasGetStatusString(k3_st_), ")");                                                                \
  } while (0)
