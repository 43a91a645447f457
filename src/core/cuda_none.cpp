// core/cuda.h in a build without the CUDA backend (nvcc was not found, or -DK3_CUDA=OFF).
#ifndef K3_HAVE_CUDA
#include "core/cuda.h"
#include "core/error.h"

namespace k3::cuda {

namespace {
[[noreturn]] void no_cuda() { fail("this k3 was built without the CUDA backend (nvcc not found at build time)"); }
}  // namespace

bool available(std::string* why) {
  if (why) *why = "this build has no CUDA backend";
  return false;
}
std::string device_summary() { no_cuda(); }
void* device_alloc(size_t) { no_cuda(); }
void device_free(void*) noexcept {}
void copy_to_device(void*, const void*, size_t) { no_cuda(); }
void copy_to_host(void*, const void*, size_t) { no_cuda(); }
void copy_on_device(void*, const void*, size_t) { no_cuda(); }
void zero_on_device(void*, size_t) { no_cuda(); }
void synchronize() { no_cuda(); }
void memory_info(size_t*, size_t*) { no_cuda(); }
std::unique_ptr<Graph> Graph::capture(const std::function<void()>&) { no_cuda(); }
Graph::~Graph() = default;
void Graph::launch() { no_cuda(); }
EventTimer::EventTimer() { no_cuda(); }
EventTimer::~EventTimer() = default;
void EventTimer::start() { no_cuda(); }
float EventTimer::stop_ms() { no_cuda(); }
float median_ms(const std::function<void(int)>&, int, int, const std::function<void(int)>&) { no_cuda(); }

}  // namespace k3::cuda
#endif
