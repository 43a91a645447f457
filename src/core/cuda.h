// The CUDA runtime, the k3 way: every CUDA/cuBLAS call is checked and a failure becomes a k3::Error
// naming the call, the file and line and CUDA's own message; device memory is owned by RAII buffers.
//
// This header is plain C++ (no CUDA headers), so CPU code and tests can ask whether a GPU is there
// without being compiled by nvcc. Everything is declared always; without the CUDA backend
// (K3_HAVE_CUDA unset) `cuda::available()` is false and the rest throws a k3::Error saying the build
// has no CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace k3::cuda {

// True when this build has the CUDA backend and a device of compute capability 9.0 (Hopper) is
// visible. `why` (optional) receives the reason when it is false.
bool available(std::string* why = nullptr);

// All kernels of the CUDA backend run on the calling thread's default stream, in order (the backend is built
// with --default-stream per-thread; cuBLAS is pointed at the same stream). A model is driven by one thread at a
// time; work handed to another thread must be finished first (a copy to the host or synchronize()).
// Device name, SM count and memory, for benchmark headers.
std::string device_summary();

// Raw device memory (cudaMalloc / cudaFree), zero-initialised, with host copies. Throws k3::Error
// on failure (out of memory names the size).
void* device_alloc(size_t bytes);
void device_free(void* p) noexcept;
void copy_to_device(void* dst, const void* src, size_t bytes);
void copy_to_host(void* dst, const void* src, size_t bytes);
void copy_on_device(void* dst, const void* src, size_t bytes);  // device to device, queued on the stream
void zero_on_device(void* dst, size_t bytes);                   // queued on the stream
void synchronize();
// Free and total device memory (cudaMemGetInfo), for benchmarks' memory figures.
void memory_info(size_t* free_bytes, size_t* total_bytes);

// A CUDA graph of the work a function queues on this thread's stream: capture() runs f under stream capture
// (nothing executes then) and instantiates the graph; launch() replays it, queued on the stream like any launch.
// f must queue only capturable work: kernels, async copies and memsets, cuBLAS with its workspace set; no
// allocation, no synchronous copy, no synchronisation. Anything else fails the capture: capture() then throws
// k3::Error with CUDA's message, and the stream is usable again.
class Graph {
 public:
  static std::unique_ptr<Graph> capture(const std::function<void()>& f);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch();

 private:
  Graph() = default;
  void* exec_ = nullptr;
};

// Times GPU work on the default stream with CUDA events (for benchmarks): start(), run kernels,
// stop_ms() waits for them and returns the elapsed milliseconds.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start();
  float stop_ms();

 private:
  void* start_ = nullptr;
  void* stop_ = nullptr;
};

// Benchmarks' timing rule, in one place: `warmup` untimed calls f(0..warmup-1), a synchronisation,
// then `reps` calls f(0..reps-1) each timed alone with CUDA events (before_each(i), if given, runs
// untimed just before call i: an L2 flush, say). Returns the median in milliseconds.
float median_ms(const std::function<void(int)>& f, int reps, int warmup = 2,
                const std::function<void(int)>& before_each = {});

// An owned device array of n elements of T.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : p_(static_cast<T*>(device_alloc(n * sizeof(T)))), n_(n) {}
  DeviceBuffer(const T* host, size_t n) : DeviceBuffer(n) { copy_to_device(p_, host, n * sizeof(T)); }
  ~DeviceBuffer() { device_free(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      device_free(p_);
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return p_; }
  const T* data() const { return p_; }
  size_t size() const { return n_; }
  void upload(const T* host, size_t n) { copy_to_device(p_, host, n * sizeof(T)); }
  void download(T* host, size_t n) const { copy_to_host(host, p_, n * sizeof(T)); }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace k3::cuda
