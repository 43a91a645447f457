// The TRAINING MLA attention core on the GPU: the fp32 SIMT kernels (kernels/mla/mla_train_cuda.h)
// beside the bf16 tensor-core kernels (kernels/mla/mla_train_tc_cuda.h), forward and forward+backward.
//
//   build/bench_cuda_train_mla [--reps N] [--no-fp32]
//
// Shapes: B=1 (one sequence of T rows, cu_seqlens = {0, T}), H = 64 and 16, K3's heads (Dn 128,
// Dr 64: qk = 192; Dv 128), scale 1/sqrt(192), causal, T = 4096, 8192, 32768. fp32 buffers in and out
// (the trainer's layout: q [T, H*192], kv [T, H*256], k_rot [T, 64], o and dO [T, H*128]).
// FLOPs (the causal half only, the convention of FlashAttention's and PyTorch's benchmarks), with
// pairs = T(T+1)/2 seen (query, key) pairs per head:
//   forward           = 2·H·pairs·(qk + v)                 (S = Q Kᵀ and O = P V)
//   backward          = 2·H·pairs·(3·qk + 2·v)             (S recomputed, dP = dO Vᵀ, dV, dK, dQ)
//   forward+backward  = 2·H·pairs·(4·qk + 3·v)             (K3: = 3.6 x forward)
// The backward's kernels recompute S and dP once more (in the dQ pass); that work is not counted.
// Each figure is the median of CUDA-event timings after warm-up launches (fewer for the slow fp32
// kernels at long T). "fwd+bwd" times one forward and one backward (with its Delta pre-pass) back to
// back. Without a Hopper GPU it prints why and exits 0.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "core/cuda.h"                      // defines: cuda::DeviceBuffer, median_ms
#include "gpu_bench.h"                      // defines: k3bench::run_gpu_bench
#include "kernels/mla/mla_train_cuda.h"     // defines: mla::cuda::attention_forward_train, ...
#include "kernels/mla/mla_train_tc_cuda.h"  // defines: mla::cuda::attention_forward_train_bf16, ...

using namespace k3;
namespace mc = k3::mla::cuda;

namespace {

// Fills n fp32 device elements with N(0, std) values: a 4 Mi-element random block copied repeatedly.
void fill_f32(float* dev, size_t n, uint64_t seed, float std) {
  const size_t block = std::min<size_t>(n, size_t(1) << 22);
  std::vector<float> h(block);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, std);
  for (auto& x : h) x = nd(rng);
  for (size_t off = 0; off < n; off += block) cuda::copy_to_device(dev + off, h.data(), std::min(block, n - off) * 4);
}

struct Problem {
  int64_t T, H;
  mla::Dims d;
  int64_t ldq, ldkv, ldo;
  cuda::DeviceBuffer<float> q, kv, kr, o, lse, d_o, dq, dkv, dkr;
  cuda::DeviceBuffer<int32_t> cu;
  cuda::DeviceBuffer<unsigned char> ws;
  float scale;
  Problem(int64_t T_, int64_t H_)
      : T(T_),
        H(H_),
        d{H_, 128, 64, 128, 512},
        ldq(H_ * 192),
        ldkv(H_ * 256),
        ldo(H_ * 128),
        q(size_t(T_ * ldq)),
        kv(size_t(T_ * ldkv)),
        kr(size_t(T_ * 64)),
        o(size_t(T_ * ldo)),
        lse(size_t(H_ * T_)),
        d_o(size_t(T_ * ldo)),
        dq(size_t(T_ * ldq)),
        dkv(size_t(T_ * ldkv)),
        dkr(size_t(T_ * 64)),
        cu(2),
        ws(std::max({mc::attention_backward_workspace_bytes(T_, d), mc::attention_backward_workspace_bytes_bf16(T_, d),
                     mc::attention_forward_workspace_bytes_bf16(T_, d)})),
        scale(float(1.0 / std::sqrt(192.0))) {
    fill_f32(q.data(), q.size(), 1, 1.0f);
    fill_f32(kv.data(), kv.size(), 2, 1.0f);
    fill_f32(kr.data(), kr.size(), 3, 1.0f);
    fill_f32(d_o.data(), d_o.size(), 4, 1.0f);
    const int32_t c[2] = {0, int32_t(T_)};
    cuda::copy_to_device(cu.data(), c, sizeof(c));
  }
  void forward(bool bf16) {
    if (bf16)
      mc::attention_forward_train_bf16(o.data(), ldo, lse.data(), q.data(), ldq, kv.data(), ldkv, kr.data(), 64,
                                       cu.data(), 1, T, T, d, scale, ws.data());
    else
      mc::attention_forward_train(o.data(), ldo, lse.data(), q.data(), ldq, kv.data(), ldkv, kr.data(), 64, cu.data(),
                                  1, T, T, d, scale);
  }
  void backward(bool bf16) {
    if (bf16)
      mc::attention_backward_train_bf16(dq.data(), ldq, dkv.data(), ldkv, dkr.data(), 64, d_o.data(), ldo, o.data(),
                                        q.data(), ldq, kv.data(), ldkv, kr.data(), 64, lse.data(), cu.data(), 1, T, T,
                                        d, scale, ws.data());
    else
      mc::attention_backward_train(dq.data(), ldq, dkv.data(), ldkv, dkr.data(), 64, d_o.data(), ldo, o.data(),
                                   q.data(), ldq, kv.data(), ldkv, kr.data(), 64, lse.data(), cu.data(), 1, T, T, d,
                                   scale, ws.data());
  }
};

void bench(int reps, bool fp32) {
  const double qk = 192, v = 128;
  std::printf("\ntraining attention, causal, B=1, qk=192 (128 nope + 64 rope), v=128, fp32 buffers\n");
  std::printf("%-5s %-6s %-10s %10s %9s %12s %9s\n", "H", "T", "kernel", "fwd ms", "TFLOP/s", "fwd+bwd ms", "TFLOP/s");
  for (const int64_t H : {int64_t(64), int64_t(16)}) {
    for (const int64_t T : {int64_t(4096), int64_t(8192), int64_t(32768)}) {
      Problem p(T, H);
      const double pairs = double(T) * double(T + 1) / 2.0;
      const double f_fwd = 2.0 * double(H) * pairs * (qk + v);
      const double f_all = 2.0 * double(H) * pairs * (4.0 * qk + 3.0 * v);
      for (const bool bf16 : {false, true}) {
        if (!bf16 && !fp32) continue;
        // The fp32 SIMT kernels take seconds at T = 32K, H = 64: fewer repetitions there.
        const int r = bf16 ? reps : std::max(1, T >= 32768 ? reps / 10 : reps / 4);
        const int warm = bf16 ? 2 : 1;
        const double ms_f = cuda::median_ms([&](int) { p.forward(bf16); }, r, warm);
        const double ms_a = cuda::median_ms(
            [&](int) {
              p.forward(bf16);
              p.backward(bf16);
            },
            r, warm);
        const char* name = bf16 ? "bf16-mma" : "fp32-simt";
        std::printf("%-5lld %-6lld %-10s %10.3f %9.1f %12.3f %9.1f\n", (long long)H, (long long)T, name, ms_f,
                    f_fwd / (ms_f * 1e-3) / 1e12, ms_a, f_all / (ms_a * 1e-3) / 1e12);
        std::printf(
            "mla_train_attn kernel=%s B=1 T=%lld H=%lld qk=192 v=128 fwd_ms=%.4f fwd_tflops=%.2f "
            "fwdbwd_ms=%.4f fwdbwd_tflops=%.2f\n",
            name, (long long)T, (long long)H, ms_f, f_fwd / (ms_f * 1e-3) / 1e12, ms_a, f_all / (ms_a * 1e-3) / 1e12);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  int reps = 20;
  bool fp32 = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--no-fp32") == 0) {
      fp32 = false;
    } else {
      std::fprintf(stderr, "usage: bench_cuda_train_mla [--reps N] [--no-fp32]\n");
      return 2;
    }
  }
  return k3bench::run_gpu_bench("bench_cuda_train_mla", reps, [&] { bench(reps, fp32); });
}
