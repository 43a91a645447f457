// Internal to kernels/moe (.cu files built for sm_90a only): what the warp-specialised grouped GEMMs
// (moe_gemm_sm90.cu for inference, expert_gemm_train_cuda.cu for training) share beyond
// common/sm90_ptx.cuh: the SM count and the dynamic schedule's counter.
#pragma once
#include <cstdint>

#include "kernels/common/sm90_ptx.cuh"

namespace k3::moe::cuda::sm90 {

// Multiprocessors of the current device (read once).
int sm_count();

// The dynamic schedule's counter on the current device (one int, allocated once per device, zeroed on the
// default stream before each launch). One counter serves every launch of both kernels, so launches must
// not overlap: the CUDA backend issues all its work on the default stream from one host thread. Two
// streams, or two host threads interleaving memset and launch, would need one counter per launch.
int* schedule_counter();

}  // namespace k3::moe::cuda::sm90
