// Internal to kernels/moe (.cu files built for sm_90a only): what the warp-specialised grouped GEMMs
// (moe_gemm_sm90.cu for inference, expert_gemm_train_sm90.cu for training) share: the 128-byte
// swizzle both write their shared tiles in, a stage wait that cannot hang, the SM count and the
// dynamic schedule's counter.
#pragma once
#include <cstdint>

#include "kernels/common/sm90_ptx.cuh"

namespace k3::moe::cuda::sm90 {

// Byte offset of 16-byte chunk c (0..7) of 128-byte row r in a tile with the 128-byte swizzle (the
// tile 1024-byte aligned): TMA's SWIZZLE_128B and the wgmma descriptor's layout 1. The swizzle is a
// function of the address (bits 4-6 ^= bits 7-9), so the same formula places K-major rows and the
// k rows of an MN-major atom.
__device__ __forceinline__ uint32_t swz128(int r, int c) { return uint32_t(r * 128 + ((c ^ (r & 7)) << 4)); }

// A stage wait that cannot hang: a barrier still incomplete after kWaitTrapNs means a broken
// pipeline (a bug, or a tensor map the copy engine rejected), and a trap turns it into a launch
// error instead of a hung process.
constexpr uint64_t kWaitTrapNs = 10ull * 1000 * 1000 * 1000;
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ void wait_or_trap(uint32_t bar, uint32_t parity) {
  if (ptx::mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = global_ns();
  for (uint32_t n = 1; !ptx::mbar_try_wait(bar, parity); ++n)
    if ((n & 1023u) == 0 && global_ns() - t0 > kWaitTrapNs) __trap();
}

// Multiprocessors of the current device (read once).
int sm_count();

// The dynamic schedule's counter on the current device (one int, allocated once per device, zeroed on the
// default stream before each launch). One counter serves every launch of both kernels, so launches must
// not overlap: the CUDA backend issues all its work on the default stream from one host thread. Two
// streams, or two host threads interleaving memset and launch, would need one counter per launch.
int* schedule_counter();

}  // namespace k3::moe::cuda::sm90
