// Programmatic dependent launch (sm_90): a kernel launched with launch_pdl may start while the kernel before it in
// the stream is still running, and overlaps its launch and its reads of weights with that kernel's tail.
//
// A decode step at one sequence is ~400 kernels of a few microseconds, each a short chain of memory round trips
// (docs/BENCHMARKS.md has the profile). A plain launch starts a kernel only once its predecessor has finished and
// its writes are visible; with the launch attribute the hardware starts it as soon as every block of the
// predecessor has called pdl_launch_dependents (or exited). The contract, for every kernel launched this way:
//   - before pdl_wait it reads only what no kernel of the step writes (weights, norm weights, biases) and writes
//     nothing: pdl_wait returns once the predecessor grid has COMPLETED and its writes are visible, and since the
//     predecessor waited on its own predecessor before completing, everything earlier in the stream is done too;
//   - it calls pdl_wait (uniformly, in every thread that reads or writes anything else) before the rest;
//   - it calls pdl_launch_dependents right after pdl_wait: the next kernel may then be scheduled and prefetch its
//     weights while this one runs. Triggering after the wait, not before, keeps at most two kernels of the chain
//     resident at once.
// A kernel launched without the attribute (cuBLAS, a plain <<<>>> launch) waits for everything before it as
// usual, and pdl_wait in a kernel launched plainly returns at once. So converting one kernel at a time is safe.
// Stream capture records the attribute as a programmatic edge of the graph (CUDA 12.3+), so decode graphs keep it.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "core/cuda_check.cuh"

namespace k3::pdl {

// Wait until the predecessor grid has completed and its memory is visible (no-op without the launch attribute).
__device__ __forceinline__ void wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Let the stream's next kernel be scheduled once every block of this grid has called this (or exited).
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Both, in the order the contract above asks.
__device__ __forceinline__ void wait_then_release() {
  wait();
  launch_dependents();
}

// kernel<<<grid, block, smem>>>(args...) on this thread's default stream, with the programmatic-serialization
// attribute. The kernel must follow the contract above.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = cudaStreamPerThread;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  K3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace k3::pdl
