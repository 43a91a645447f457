// GPU MLA attention at K3 dims (kernels/mla/mla_cuda.h): prefill time and TFLOP/s, decode time and GB/s.
//
//   build/bench_cuda_mla [--reps N]
//
// prefill: B=1, H=64, qk 192 (128 nope + 64 rope), v 128, causal, bf16 in and out, T = 4096, 8192,
//          32768 (n = T, p0 = 0). FLOPs counted = 2 * H * (qk + v) * T*(T+1)/2 (the causal half only:
//          the work a flash kernel does, the convention of FlashAttention's benchmarks).
// decode:  one new token (n = 1) of B=1, H=64 heads over a cache of T = 8K, 64K, 256K rows of
//          [latent 512 | k_rot 64] bf16, q_lat f32, split-K over T. GB/s counts the cache bytes read
//          (T * 576 * 2); the roofline is the H200's ~4.3 TB/s copy bandwidth (ANCHORS.md). The
//          FLOPs (2 * H * T * (576 + 512)) are printed too: at 64 heads the absorbed decode does
//          ~121 FLOP per cache byte, near the H200's ~165 FLOP/byte (790 TFLOP/s / 4.8 TB/s)
//          balance point, so a mma.sync kernel is bounded by its tensor-core rate as much as by HBM.
// Each figure is the median of --reps CUDA-event timings after two warm-up launches; decode cycles
// through enough cache copies that each timed launch reads its cache from HBM, not from L2.
// Without a Hopper GPU it prints why and exits 0.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "core/cuda.h"             // defines: cuda::DeviceBuffer, median_ms
#include "core/dtype.h"            // defines: f32_to_bf16
#include "gpu_bench.h"             // defines: k3bench::run_gpu_bench
#include "kernels/mla/mla_cuda.h"  // defines: mla::cuda::prefill, mla::cuda::decode

using namespace k3;
namespace mc = k3::mla::cuda;

namespace {

// Fills n bf16 device elements with N(0, std) values: a 4 Mi-element random block copied repeatedly.
void fill_bf16(uint16_t* dev, size_t n, uint64_t seed, float std) {
  const size_t block = std::min<size_t>(n, size_t(1) << 22);
  std::vector<uint16_t> h(block);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, std);
  for (auto& x : h) x = f32_to_bf16(nd(rng));
  for (size_t off = 0; off < n; off += block) cuda::copy_to_device(dev + off, h.data(), std::min(block, n - off) * 2);
}
void fill_f32(float* dev, size_t n, uint64_t seed, float std) {
  std::vector<float> h(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, std);
  for (auto& x : h) x = nd(rng);
  cuda::copy_to_device(dev, h.data(), n * 4);
}

template <class F>
double median_ms(int reps, F&& run) {
  return cuda::median_ms([&](int r) { run(r); }, reps, 2);
}

void bench_prefill(int reps) {
  const int64_t H = 64, Dn = 128, Dr = 64, Dv = 128, dq = Dn + Dr;
  std::printf("\nprefill (expanded form, causal, bf16 q/k/v/o), B=1 H=%lld qk=%lld v=%lld\n", (long long)H,
              (long long)dq, (long long)Dv);
  std::printf("%-8s %8s %10s %10s\n", "T", "B", "ms", "TFLOP/s");
  for (const int64_t T : {int64_t(4096), int64_t(8192), int64_t(32768)}) {
    cuda::DeviceBuffer<uint16_t> q(size_t(T * H * dq)), k(size_t(T * H * dq)), v(size_t(T * H * Dv)),
        o(size_t(T * H * Dv));
    fill_bf16(q.data(), q.size(), 1, 1.0f);
    fill_bf16(k.data(), k.size(), 2, 1.0f);
    fill_bf16(v.data(), v.size(), 3, 1.0f);
    mc::PrefillParams p;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.o = o.data();
    p.o_type = mc::Dtype::BF16;
    p.d = mla::Dims{H, Dn, Dr, Dv, 512};
    p.B = 1;
    p.n = T;
    p.p0 = 0;
    const double ms = median_ms(T >= 32768 ? std::max(3, reps / 4) : reps, [&](int) { mc::prefill(p); });
    const double flops = 2.0 * double(H) * double(dq + Dv) * double(T) * double(T + 1) / 2.0;
    std::printf("%-8lld %8d %10.3f %10.1f\n", (long long)T, 1, ms, flops / (ms * 1e-3) / 1e12);
    std::printf("mla_prefill B=1 T=%lld H=%lld qk=%lld v=%lld ms=%.4f tflops=%.1f\n", (long long)T, (long long)H,
                (long long)dq, (long long)Dv, ms, flops / (ms * 1e-3) / 1e12);
  }
}

void bench_decode(int reps) {
  const int64_t H = 64, Dn = 128, Dr = 64, R = 512, ldc = R + Dr;
  std::printf("\ndecode (absorbed, n=1, B=1 H=%lld, cache rows [latent %lld | k_rot %lld] bf16, q_lat f32)\n",
              (long long)H, (long long)R, (long long)Dr);
  std::printf("%-8s %7s %10s %10s %10s\n", "T", "splits", "us", "GB/s", "TFLOP/s");
  cuda::DeviceBuffer<float> q_lat(size_t(H * R)), q_rot(size_t(H * Dr)), o(size_t(H * R));
  fill_f32(q_lat.data(), q_lat.size(), 4, 1.0f);
  fill_f32(q_rot.data(), q_rot.size(), 5, 1.0f);
  for (const int64_t T : {int64_t(8192), int64_t(65536), int64_t(262144)}) {
    const size_t cache_bytes = size_t(T * ldc * 2);
    // Enough copies that the copies together exceed the 60 MB L2 three times over.
    const int copies = int(std::clamp<size_t>((size_t(192) << 20) / cache_bytes + 1, 1, 32));
    cuda::DeviceBuffer<uint16_t> caches(size_t(copies) * size_t(T * ldc));
    fill_bf16(caches.data(), caches.size(), 6, 1.0f);
    mc::DecodeParams p;
    p.q_lat = q_lat.data();
    p.q_rot = q_rot.data();
    p.q_type = mc::Dtype::F32;
    p.cache = caches.data();
    p.ldc = ldc;
    p.o_lat = o.data();
    p.d = mla::Dims{H, Dn, Dr, 128, R};
    p.B = 1;
    p.n = 1;
    p.p0 = T - 1;
    const int splits = mc::decode_splits(p);
    cuda::DeviceBuffer<unsigned char> ws(mc::decode_workspace_bytes(p));
    p.workspace = ws.data();
    p.workspace_bytes = ws.size();
    const double ms = median_ms(reps * 4, [&](int r) {
      p.cache = caches.data() + size_t(r % copies) * size_t(T * ldc);
      mc::decode(p);
    });
    const double gbs = double(cache_bytes) / (ms * 1e-3) / 1e9;
    const double tflops = 2.0 * double(H) * double(T) * double(ldc + R) / (ms * 1e-3) / 1e12;
    std::printf("%-8lld %7d %10.2f %10.1f %10.1f\n", (long long)T, splits, ms * 1e3, gbs, tflops);
    std::printf("mla_decode B=1 n=1 T=%lld H=%lld R=%lld Dr=%lld splits=%d us=%.2f gbs=%.1f tflops=%.1f\n",
                (long long)T, (long long)H, (long long)R, (long long)Dr, splits, ms * 1e3, gbs, tflops);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_cuda_mla [--reps N]\n");
      return 2;
    }
  }
  return k3bench::run_gpu_bench("bench_cuda_mla", reps, [&] {
    bench_prefill(reps);
    bench_decode(reps);
  });
}
