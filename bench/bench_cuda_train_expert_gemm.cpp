// The routed experts' training GEMMs on the GPU: the one-launch grouped kernels
// (kernels/moe/expert_gemm_train_cuda.h) against the per-expert cuBLAS loop (experts_linear_*, BF16,
// moe_train_cuda.h) and against ONE cuBLAS bf16 GEMM of the same FLOPs (the ceiling).
//
//   build/bench_cuda_train_expert_gemm [--reps 20] [--warmup 3]
//
// Shapes: k3-1b (E = 192, top-4, 8192 tokens, L = I = 256) and K3-shaped experts (E = 8, top-4, 8192
// tokens, L = 3584, I = 3072: the gate/up linear out = I, in = L, and the down linear out = L, in = I),
// and K3's gate/up at 16, 32 and 64 experts (2,048 to 512 rows each).
// Routing drawn at random (each token's K experts distinct, uniform). S = tokens·K sorted rows; bf16
// operands, fp32 outputs, as training holds them. The ops, each over all experts:
//   fwd    y [S, out] = x · W_eᵀ            cuBLAS ceiling: [S, in] × [in, out]
//   bwd-d  dx [S, in] = dy · W_e            ceiling: [S, out] × [out, in]
//   bwd-w  dW_e [out, in] += dy_eᵀ · x_e    ceiling: [out, S] × [S, in] (k = S)
// Each time is the median of --reps runs after --warmup, CUDA events around one call (the per-expert
// loop: around all its calls). TFLOP/s = 2·S·out·in / time. "% cuBLAS" = the ceiling's time over the
// grouped kernel's. Exits 0 with a message when there is no GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/dtype.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/moe/expert_gemm_train_cuda.h"
#include "kernels/moe/moe_train_cuda.h"

#ifdef K3_HAVE_CUDA
namespace mc = k3::moe::cuda;
namespace gc = k3::gemm::cuda;
using k3::DType;
using k3::cuda::DeviceBuffer;

namespace {

struct Shape {
  const char* name;
  int64_t E, K, tokens, out, in;
};
const Shape kShapes[] = {{"k3-1b W1/W3/W2", 192, 4, 8192, 256, 256},
                         {"K3 W1/W3 (I x L)", 8, 4, 8192, 3072, 3584},
                         {"K3 W2 (L x I)", 8, 4, 8192, 3584, 3072},
                         // Where one cuBLAS call per expert overtakes the grouped kernel (the
                         // trainer's choice, ffn_train.cpp): K3's gate/up shape at 2,048, 1,024
                         // and 512 rows per expert.
                         {"K3 W1/W3, 16 experts", 16, 4, 8192, 3072, 3584},
                         {"K3 W1/W3, 32 experts", 32, 4, 8192, 3072, 3584},
                         {"K3 W1/W3, 64 experts", 64, 4, 8192, 3072, 3584}};

DeviceBuffer<uint16_t> random_bf16(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> h(n);
  for (uint16_t& v : h) v = k3::f32_to_bf16(nd(rng));
  return DeviceBuffer<uint16_t>(h.data(), n);
}

void run_shape(const Shape& s, int warmup, int reps) {
  std::mt19937_64 rng(uint64_t(s.E * 1000 + s.out));
  const int64_t N = s.tokens, S = N * s.K, E = s.E, out = s.out, in = s.in;
  std::vector<int32_t> idx(static_cast<size_t>(S));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t k = 0; k < s.K; ++k) {  // partial Fisher-Yates: K distinct experts
      std::uniform_int_distribution<int64_t> d(k, E - 1);
      std::swap(perm[size_t(k)], perm[size_t(d(rng))]);
      idx[size_t(n * s.K + k)] = perm[size_t(k)];
    }
  }
  DeviceBuffer<int32_t> idx_d(idx.data(), idx.size());
  mc::TrainDispatch d(N, E, s.K);
  d.build(idx_d.data(), N);
  int64_t lo = S, hi = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = d.offsets()[size_t(e + 1)] - d.offsets()[size_t(e)];
    lo = std::min(lo, c), hi = std::max(hi, c);
  }

  DeviceBuffer<uint16_t> x = random_bf16(rng, size_t(S * in)), dy = random_bf16(rng, size_t(S * out)),
                         W = random_bf16(rng, size_t(E * out * in));
  DeviceBuffer<float> y(size_t(S * out)), dx(size_t(S * in)), dW(size_t(E * out * in)), dW1(size_t(out * in));
  DeviceBuffer<unsigned char> ws(mc::grouped_linear_workspace_bytes(E));
  gc::GemmContext ctx;
  const int32_t* offs = d.offsets_device();

  auto time = [&](const std::function<void()>& f) { return k3::cuda::median_ms([&](int) { f(); }, reps, warmup); };
  const double flops = 2.0 * double(S) * double(out) * double(in);
  auto tflops = [&](float ms) { return flops / (double(ms) * 1e-3) / 1e12; };

  struct Op {
    const char* name;
    std::function<void()> grouped, loop, ceiling;
  };
  const Op ops[] = {
      {"fwd",
       [&] { mc::grouped_linear_forward_bf16(y.data(), x.data(), W.data(), offs, S, E, out, in, false, ws.data()); },
       [&] { mc::experts_linear_forward(ctx, y.data(), x.data(), W.data(), DType::BF16, d, out, in); },
       [&] { gc::linear_bf16(ctx, y.data(), x.data(), W.data(), S, out, in); }},
      {"bwd-d",
       [&] {
         mc::grouped_linear_backward_data_bf16(dx.data(), dy.data(), W.data(), offs, S, E, out, in, false, ws.data());
       },
       [&] { mc::experts_linear_backward_data(ctx, dx.data(), dy.data(), W.data(), DType::BF16, d, out, in); },
       [&] {
         gc::LinearParams p;
         p.y = dx.data(), p.y_type = DType::F32, p.x = dy.data(), p.w = W.data(), p.in_type = DType::BF16;
         p.w_in_out = true, p.M = S, p.N = in, p.K = out;
         gc::linear_forward(ctx, p);
       }},
      {"bwd-w", [&] { mc::grouped_linear_backward_weight_bf16(dW.data(), dy.data(), x.data(), offs, S, E, out, in); },
       [&] { mc::experts_linear_backward_weight(ctx, dW.data(), dy.data(), x.data(), DType::BF16, d, out, in); },
       [&] {
         gc::WeightGradParams p;
         p.dw = dW1.data(), p.dy = dy.data(), p.x = x.data(), p.in_type = DType::BF16;
         p.M = S, p.N = out, p.K = in;
         gc::linear_weight_grad(ctx, p);
       }},
  };
  std::printf(
      "\n%s: E %lld, top-%lld, %lld tokens -> S %lld rows (per expert %lld..%lld), out %lld, in %lld, "
      "%.1f GFLOP per op\n",
      s.name, (long long)E, (long long)s.K, (long long)N, (long long)S, (long long)lo, (long long)hi, (long long)out,
      (long long)in, flops * 1e-9);
  std::printf("  %-6s %21s %21s %21s %9s %9s\n", "op", "grouped ms (TFLOP/s)", "per-expert ms (TF/s)",
              "1 cuBLAS ms (TF/s)", "% cuBLAS", "x loop");
  for (const Op& o : ops) {
    const float tg = time(o.grouped), tl = time(o.loop), tc = time(o.ceiling);
    std::printf("  %-6s %10.4f (%7.1f)   %10.4f (%7.1f)   %10.4f (%7.1f)   %7.1f%%  %8.2fx\n", o.name, tg, tflops(tg),
                tl, tflops(tl), tc, tflops(tc), 100.0 * tc / tg, tl / tg);
  }
}

}  // namespace
#endif

int main(int argc, char** argv) {
  int reps = 20, warmup = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--warmup" && i + 1 < argc) warmup = std::max(0, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: bench_cuda_train_expert_gemm [--reps N] [--warmup N]\n");
      return 2;
    }
  }
  std::string why;
  if (!k3::cuda::available(&why)) {
    std::printf("bench_cuda_train_expert_gemm: no usable GPU (%s); nothing to measure.\n", why.c_str());
    return 0;
  }
#ifdef K3_HAVE_CUDA
  std::printf("%s\n", k3::cuda::device_summary().c_str());
  std::printf("Routed-expert training GEMMs, bf16 operands, fp32 out; median of %d after %d warm-up\n", reps, warmup);
  for (const Shape& s : kShapes) run_shape(s, warmup, reps);
#endif
  return 0;
}
