// core/cuda.h with the CUDA backend.
#include <algorithm>
#include <vector>

#include "core/cuda.h"
#include "core/cuda_check.cuh"

namespace k3::cuda {

bool available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why) *why = e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(e) : "no CUDA device";
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess || p.major != 9) {
    if (why) *why = std::string("device 0 (") + p.name + ") is not compute capability 9.x; this build targets sm_90a";
    return false;
  }
  return true;
}

std::string device_summary() {
  cudaDeviceProp p{};
  K3_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(p.totalGlobalMem >> 30) + " GiB";
}

void* device_alloc(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail("CUDA: cannot allocate ", bytes, " bytes of device memory: ", cudaGetErrorString(e));
  }
  K3_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

void device_free(void* p) noexcept {
  if (p) cudaFree(p);
}

void copy_to_device(void* dst, const void* src, size_t bytes) {
  if (bytes) K3_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void copy_to_host(void* dst, const void* src, size_t bytes) {
  if (bytes) K3_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void copy_on_device(void* dst, const void* src, size_t bytes) {
  if (bytes) K3_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
}

void zero_on_device(void* dst, size_t bytes) {
  if (bytes) K3_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, 0));
}

void synchronize() { K3_CUDA_CHECK(cudaDeviceSynchronize()); }
void memory_info(size_t* free_bytes, size_t* total_bytes) { K3_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes)); }

std::unique_ptr<Graph> Graph::capture(const std::function<void()>& f) {
  const cudaStream_t s = cudaStreamPerThread;
  K3_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t g = nullptr;
  try {
    f();
  } catch (...) {  // end the capture (the stream is then usable again), then report
    cudaStreamEndCapture(s, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  const cudaError_t e = cudaStreamEndCapture(s, &g);
  if (e != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    fail("CUDA graph capture failed: ", cudaGetErrorString(e));
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ie = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (ie != cudaSuccess) {
    cudaGetLastError();
    fail("CUDA graph instantiation failed: ", cudaGetErrorString(ie));
  }
  auto out = std::unique_ptr<Graph>(new Graph());
  out->exec_ = exec;
  return out;
}

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

void Graph::launch() { K3_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), cudaStreamPerThread)); }

EventTimer::EventTimer() {
  cudaEvent_t a, b;
  K3_CUDA_CHECK(cudaEventCreate(&a));
  K3_CUDA_CHECK(cudaEventCreate(&b));
  start_ = a;
  stop_ = b;
}
EventTimer::~EventTimer() {
  if (start_) cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  if (stop_) cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
}
void EventTimer::start() { K3_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_))); }
float EventTimer::stop_ms() {
  K3_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(stop_)));
  K3_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(stop_)));
  float ms = 0.0f;
  K3_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_), static_cast<cudaEvent_t>(stop_)));
  return ms;
}

float median_ms(const std::function<void(int)>& f, int reps, int warmup, const std::function<void(int)>& before_each) {
  if (reps < 1) fail("median_ms: reps must be at least 1, got ", reps);
  for (int i = 0; i < warmup; ++i) f(i);
  synchronize();
  EventTimer timer;
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    if (before_each) before_each(i);
    timer.start();
    f(i);
    ms.push_back(timer.stop_ms());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace k3::cuda
