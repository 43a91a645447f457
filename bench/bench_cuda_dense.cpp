// Throughput of the dense CUDA building blocks at K3 shapes (hidden 7168), against baselines
// measured in the same run:
//   - copy:    cudaMemcpy device-to-device of 1 GiB; GB/s counts read + write. The roofline for
//              every memory-bound kernel below ("% copy").
//   - gemm:    BF16 x BF16 -> F32 / BF16 through cuBLASLt (heuristic's first algorithm) and
//              cublasGemmEx, TFLOP/s, plus the GB/s of the operands (what bounds decode, M = 1..64);
//              one F32 exact (TF32-off) shape for the parity mode's cost.
//   - rmsnorm, fused attnres(+norm) over S = 2, 5, 9 sources, SiTU-GLU, embedding gather: GB/s of
//              the bytes each must move (inputs read once + outputs written once).
// Each timed call runs after an L2 flush (a 256 MiB memset) and is timed alone with CUDA events;
// the line shows the median over --iters calls. Numbers are printed, never asserted.
//
//   build-dense/bench_cuda_dense [--iters 10] [--only gemm|norm|attnres|glu|embed|copy]
// Exits 0 with a message when the build has no CUDA backend or the machine has no Hopper GPU.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"

#if defined(K3_HAVE_CUDA)
#include <cuda_runtime.h>  // cudaMemcpy / cudaMemset for the copy baseline and the L2 flush

#include "kernels/attnres/attnres_cuda.h"
#include "kernels/ffn/glu_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/norm/norm_cuda.h"

namespace {

using namespace k3;
namespace kc = k3::cuda;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA: ", what, ": ", cudaGetErrorString(e));
}

struct Bench {
  int iters = 10;
  kc::DeviceBuffer<uint8_t> flush_buf{size_t(256) << 20};

  // Median milliseconds of `fn` over iters calls, each after an L2 flush; two warm-up calls first.
  double time_ms(const std::function<void()>& fn) {
    return kc::median_ms([&](int) { fn(); }, iters, 2,
                         [&](int i) {
                           check(cudaMemsetAsync(flush_buf.data(), i & 0xff, flush_buf.size()), "L2 flush");
                         });
  }
};

// A device buffer of n bytes filled with a byte pattern (bf16 0x3c3c ~ 0.0115, fp32 0x3c3c3c3c ~ 0.0115).
kc::DeviceBuffer<uint8_t> filled(size_t bytes, int byte = 0x3c) {
  kc::DeviceBuffer<uint8_t> b(bytes);
  check(cudaMemset(b.data(), byte, bytes), "fill");
  return b;
}

double copy_bandwidth(Bench& B) {
  const size_t bytes = size_t(1) << 30;
  auto src = filled(bytes), dst = filled(bytes, 0);
  const double ms =
      B.time_ms([&] { check(cudaMemcpy(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice), "copy"); });
  const double gbs = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  std::printf("%-44s %10.1f us %9.1f GB/s (read + write)\n", "copy d2d 1 GiB", ms * 1e3, gbs);
  return gbs;
}

void bench_gemm(Bench& B) {
  gemm::cuda::GemmContext ctx;
  struct Shape {
    const char* name;
    int64_t M, N, K;
  };
  const Shape shapes[] = {
      {"q_proj decode", 1, 12288, 7168},         {"o_proj decode", 1, 7168, 12288},
      {"lm_head decode", 1, 163840, 7168},       {"q_proj batch 64", 64, 12288, 7168},
      {"dense up 64", 64, 33792, 7168},          {"q_proj prefill", 4096, 12288, 7168},
      {"o_proj prefill", 4096, 7168, 12288},     {"dense gate prefill", 4096, 33792, 7168},
      {"dense down prefill", 4096, 7168, 33792}, {"lm_head prefill", 4096, 163840, 7168},
  };
  std::printf("\n%-44s %13s %15s %12s\n", "gemm bf16 (y = x W^T)", "time", "TFLOP/s", "operand GB/s");
  for (const Shape& s : shapes) {
    auto x = filled(size_t(s.M * s.K) * 2), w = filled(size_t(s.N * s.K) * 2);
    auto y = filled(size_t(s.M * s.N) * 4, 0);
    for (DType yt : {DType::F32, DType::BF16})
      for (auto be : {gemm::cuda::GemmBackend::Lt, gemm::cuda::GemmBackend::Classic}) {
        gemm::cuda::LinearParams p;
        p.y = y.data(), p.y_type = yt, p.x = x.data(), p.w = w.data(), p.in_type = DType::BF16;
        p.M = s.M, p.N = s.N, p.K = s.K, p.backend = be;
        char label[128];
        std::snprintf(label, sizeof label, "%s %lldx%lldx%lld ->%s %s", s.name, (long long)s.M, (long long)s.N,
                      (long long)s.K, dtype_name(yt), be == gemm::cuda::GemmBackend::Lt ? "lt" : "classic");
        try {
          const double ms = B.time_ms([&] { gemm::cuda::linear_forward(ctx, p); });
          const double tflops = 2.0 * double(s.M) * double(s.N) * double(s.K) / (ms * 1e-3) / 1e12;
          const double bytes = double(s.M * s.K + s.N * s.K) * 2 + double(s.M * s.N) * double(dtype_size(yt));
          std::printf("%-44s %10.1f us %12.1f %12.1f\n", label, ms * 1e3, tflops, bytes / (ms * 1e-3) / 1e9);
        } catch (const Error& e) {
          std::printf("%-44s skipped: %s\n", label, e.what());
        }
      }
  }
  {  // the parity mode
    const int64_t M = 1024, N = 7168, K = 7168;
    auto x = filled(size_t(M * K) * 4), w = filled(size_t(N * K) * 4), y = filled(size_t(M * N) * 4, 0);
    const double ms = B.time_ms([&] {
      gemm::cuda::linear_f32_exact(ctx, reinterpret_cast<float*>(y.data()), reinterpret_cast<const float*>(x.data()),
                                   reinterpret_cast<const float*>(w.data()), M, N, K);
    });
    std::printf("%-44s %10.1f us %12.1f\n", "f32 exact (TF32 off) 1024x7168x7168", ms * 1e3,
                2.0 * double(M * N * K) / (ms * 1e-3) / 1e12);
  }
}

void print_bw(const char* label, double ms, double bytes, double copy_gbs) {
  const double gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf("%-44s %10.1f us %9.1f GB/s %6.1f%% copy\n", label, ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
}

void bench_norm(Bench& B, double copy_gbs) {
  const int64_t N = 16384, D = 7168;
  std::printf("\n%-44s %13s %14s %12s\n", "rmsnorm (N=16384, D=7168)", "time", "bandwidth", "vs copy");
  auto w = filled(size_t(D) * 4);
  for (DType tin : {DType::F32, DType::BF16})
    for (DType tout : {DType::F32, DType::BF16}) {
      auto x = filled(size_t(N * D) * dtype_size(tin)), y = filled(size_t(N * D) * dtype_size(tout), 0);
      norm::cuda::RmsNormParams p;
      p.y = y.data(), p.y_type = tout, p.x = x.data(), p.x_type = tin;
      p.weight = reinterpret_cast<const float*>(w.data()), p.N = N, p.D = D;
      const double ms = B.time_ms([&] { norm::cuda::rmsnorm_forward(p); });
      char label[96];
      std::snprintf(label, sizeof label, "rmsnorm %s -> %s", dtype_name(tin), dtype_name(tout));
      print_bw(label, ms, double(N * D) * double(dtype_size(tin) + dtype_size(tout)), copy_gbs);
    }
}

void bench_attnres(Bench& B, double copy_gbs) {
  const int64_t N = 8192, D = 7168;
  std::printf("\n%-44s %13s %14s %12s\n", "attnres fused (N=8192, D=7168)", "time", "bandwidth", "vs copy");
  auto q = filled(size_t(D) * 4), nw = filled(size_t(D) * 4);
  for (int S : {2, 5, 9}) {
    std::vector<kc::DeviceBuffer<uint8_t>> src;
    for (int i = 0; i < S; ++i) src.push_back(filled(size_t(N * D) * 4, 0x3c + i));
    for (DType tout : {DType::BF16, DType::F32})
      for (bool with_h : {false, true}) {
        auto out = filled(size_t(N * D) * dtype_size(tout), 0), normed = filled(size_t(N * D) * dtype_size(tout), 0);
        attnres::cuda::AttnResParams p;
        for (int i = 0; i < S; ++i) p.sources[i] = src[size_t(i)].data();
        p.S = S, p.src_type = DType::F32, p.N = N, p.D = D, p.query = reinterpret_cast<const float*>(q.data());
        p.out_type = tout, p.out = with_h ? out.data() : nullptr, p.normed = normed.data();
        p.norm_weight = reinterpret_cast<const float*>(nw.data());
        const double ms = B.time_ms([&] { attnres::cuda::attnres_forward(p); });
        char label[96];
        std::snprintf(label, sizeof label, "S=%d F32 src -> %s%s", S, with_h ? "h + " : "", dtype_name(tout));
        const double bytes = double(N * D) * (4.0 * S + double(dtype_size(tout)) * (with_h ? 2 : 1));
        print_bw(label, ms, bytes, copy_gbs);
      }
  }
  {  // BF16 sources (half the bytes per source: the prefetch depth matters more)
    const int S = 9;
    std::vector<kc::DeviceBuffer<uint8_t>> src;
    for (int i = 0; i < S; ++i) src.push_back(filled(size_t(N * D) * 2, 0x3c + i));
    auto normed = filled(size_t(N * D) * 2, 0);
    attnres::cuda::AttnResParams p;
    for (int i = 0; i < S; ++i) p.sources[i] = src[size_t(i)].data();
    p.S = S, p.src_type = DType::BF16, p.N = N, p.D = D, p.query = reinterpret_cast<const float*>(q.data());
    p.out_type = DType::BF16, p.normed = normed.data(), p.norm_weight = reinterpret_cast<const float*>(nw.data());
    const double ms = B.time_ms([&] { attnres::cuda::attnres_forward(p); });
    print_bw("S=9 BF16 src -> BF16", ms, double(N * D) * (2.0 * S + 2.0), copy_gbs);
  }
}

void bench_glu(Bench& B, double copy_gbs) {
  const int64_t rows = 4096, cols = 33792;
  std::printf("\n%-44s %13s %14s %12s\n", "situ-glu (4096 x 33792, fused gate|up)", "time", "bandwidth", "vs copy");
  for (DType t : {DType::BF16, DType::F32}) {
    auto in = filled(size_t(rows * 2 * cols) * dtype_size(t)), out = filled(size_t(rows * cols) * dtype_size(t), 0);
    ffn::cuda::GluLaunch p;
    p.out = out.data(), p.out_type = t, p.gate = in.data(), p.up = in.data() + size_t(cols) * dtype_size(t);
    p.in_type = t, p.ld_in = 2 * cols, p.rows = rows, p.cols = cols;
    const double ms = B.time_ms([&] { ffn::cuda::glu_forward(p); });
    char label[96];
    std::snprintf(label, sizeof label, "situ-glu %s", dtype_name(t));
    print_bw(label, ms, double(rows * cols) * 3.0 * double(dtype_size(t)), copy_gbs);
  }
}

void bench_embed(Bench& B, double copy_gbs) {
  const int64_t T = 16384, V = 163840, D = 7168;
  std::printf("\n%-44s %13s %14s %12s\n", "embedding gather (T=16384, V=163840)", "time", "bandwidth", "vs copy");
  auto table = filled(size_t(V * D) * 2), out = filled(size_t(T * D) * 4, 0);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = int32_t((t * 104729) % V);
  kc::DeviceBuffer<int32_t> dids(ids.data(), ids.size());
  const double ms = B.time_ms([&] {
    gemm::cuda::embedding_gather(reinterpret_cast<float*>(out.data()), reinterpret_cast<const uint16_t*>(table.data()),
                                 dids.data(), T, V, D);
  });
  print_bw("embedding bf16 -> f32", ms, double(T * D) * 6.0, copy_gbs);
  auto f = filled(size_t(T * D) * 4), h = filled(size_t(T * D) * 2, 0);
  const double ms2 = B.time_ms([&] {
    gemm::cuda::convert_f32_to_bf16(reinterpret_cast<uint16_t*>(h.data()), reinterpret_cast<const float*>(f.data()),
                                    T * D);
  });
  print_bw("convert f32 -> bf16", ms2, double(T * D) * 6.0, copy_gbs);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Dense CUDA kernels at K3 shapes (see the header of bench/bench_cuda_dense.cpp)"};
  int iters = 10;
  std::string only;
  app.add_option("--iters", iters, "timed calls per case (median reported)")->capture_default_str();
  app.add_option("--only", only, "one section: copy, gemm, norm, attnres, glu, embed");
  CLI11_PARSE(app, argc, argv);
  std::string why;
  if (!k3::cuda::available(&why)) {
    std::printf("bench_cuda_dense: no GPU to run on (%s)\n", why.c_str());
    return 0;
  }
  try {
    std::printf("%s\n", k3::cuda::device_summary().c_str());
    Bench B;
    B.iters = std::max(1, iters);
    const double copy_gbs = copy_bandwidth(B);
    auto want = [&](const char* s) { return only.empty() || only == s; };
    if (want("gemm")) bench_gemm(B);
    if (want("norm")) bench_norm(B, copy_gbs);
    if (want("attnres")) bench_attnres(B, copy_gbs);
    if (want("glu")) bench_glu(B, copy_gbs);
    if (want("embed")) bench_embed(B, copy_gbs);
  } catch (const k3::Error& e) {
    std::fprintf(stderr, "bench_cuda_dense: %s\n", e.what());
    return 1;
  }
  return 0;
}

#else  // no CUDA backend in this build

int main() {
  std::printf("bench_cuda_dense: this build has no CUDA backend; nothing to measure\n");
  return 0;
}

#endif
