// Grouped expert GEMMs of K3's LatentMoE on the GPU (kernels/moe/moe_cuda.h) against cuBLAS bf16 at
// equal FLOPs, in the same run.
//
//   build/bench_cuda_moe [--config configs/kimi-k3.json] [--tokens 4096,16384] [--reps 5] [--experts N]
//                        [--formats bf16,mxfp4] [--tm 128,64] [--variants default,mma.sync]
//
// Sizes come from the config: E experts, top-K, latent L (routed_expert_hidden_size), intermediate I.
// Tokens are routed uniformly at random (K distinct experts per token), so each expert gets about
// T·K/E rows. For bf16 and MXFP4 expert weights it times (median of --reps, after 2 warm-ups):
//   gate_up  h = SiTU-GLU(z W1ᵀ, z W3ᵀ)   2·S·2I·L FLOPs   vs cuBLAS [S, L] × [L, 2I]
//   down     y = h W2ᵀ                    2·S·L·I FLOPs    vs cuBLAS [S, I] × [I, L]
//   experts  gate_up + down + combine                     vs the two cuBLAS GEMMs
// (S = T·K) and prints TFLOP/s and the ratio to cuBLAS (target >= 60%), for both tile heights
// (TM = 128 and 64 rows; `*` marks the one Dispatch::build picks by itself). Also printed: the bytes of
// expert weights each pass must read and the time that takes at the measured copy bandwidth, since at
// few rows per expert the grouped GEMM is bound by weight traffic, which one dense GEMM never is.
// --variants times each case once per GEMM configuration, named as moe::cuda::gemm_config_name writes
// them (moe_cuda.h, GemmConfig: "default" is the shipped heuristic; parts joined by '+': mma.sync,
// row-major, no-skip, narrow, ctas=N, static). The default "default,mma.sync" times bf16 at TM 128 on
// the Hopper wgmma kernel and on the mma.sync kernel side by side ("static": the wgmma kernel's static
// schedule, the baseline of its dynamic one); mma.sync variants are skipped where they change nothing
// (MXFP4 and TM 64 always run on the mma.sync kernel). --experts 16 with top-16 sends every token to
// every expert: one big group per expert, the kernel's compute-bound rate.
// Exits 0 with a message when there is no GPU.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli/args.h"
#include "core/cuda.h"
#include "core/error.h"
#include "kernels/moe/moe_cuda.h"
#include "model/config.h"

#ifdef K3_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

using namespace k3;
namespace mc = k3::moe::cuda;

#ifdef K3_HAVE_CUDA
namespace {

#define BENCH_CUBLAS(call)                                                                              \
  do {                                                                                                  \
    const cublasStatus_t st_ = (call);                                                                  \
    if (st_ != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: ", #call, " failed: ", cublasGetStatusString(st_)); \
  } while (0)

float median_ms(const std::function<void()>& f, int reps) {
  return cuda::median_ms([&](int) { f(); }, reps, 2);
}

// C[M, N] = A[M, K] · B[N, K]ᵀ, bf16 in and out, fp32 compute (row-major; cuBLAS sees Cᵀ = B · Aᵀ).
void cublas_nt(cublasHandle_t h, uint16_t* c, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K) {
  const float alpha = 1.0f, beta = 0.0f;
  BENCH_CUBLAS(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &alpha, b, CUDA_R_16BF, int(K), a,
                            CUDA_R_16BF, int(K), &beta, c, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

double copy_bandwidth_gbs() {
  const size_t bytes = static_cast<size_t>(2) << 30;
  cuda::DeviceBuffer<uint8_t> a(bytes), b(bytes);
  mc::fill_random_u8(a.data(), int64_t(bytes), 0, 255, 1);
  const float ms = median_ms([&] { cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice); }, 5);
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
}

struct Weights {
  bool mx = false;
  cuda::DeviceBuffer<uint16_t> b1, b3, b2;
  cuda::DeviceBuffer<uint8_t> p1, p3, p2, s1, s3, s2;
  mc::ExpertLinear w1, w3, w2;
  double gate_up_bytes = 0, down_bytes = 0;
};

void make_weights(Weights& w, bool mx, int64_t E, int64_t L, int64_t I) {
  w.mx = mx;
  const int64_t n = E * I * L;
  if (!mx) {
    w.b1 = cuda::DeviceBuffer<uint16_t>(static_cast<size_t>(n));
    w.b3 = cuda::DeviceBuffer<uint16_t>(static_cast<size_t>(n));
    w.b2 = cuda::DeviceBuffer<uint16_t>(static_cast<size_t>(n));
    mc::fill_random_bf16(w.b1.data(), n, 1.7f / std::sqrt(float(L)), 11);
    mc::fill_random_bf16(w.b3.data(), n, 1.7f / std::sqrt(float(L)), 12);
    mc::fill_random_bf16(w.b2.data(), n, 1.7f / std::sqrt(float(I)), 13);
    w.w1 = mc::ExpertLinear::bf16_stacked(w.b1.data(), I, L);
    w.w3 = mc::ExpertLinear::bf16_stacked(w.b3.data(), I, L);
    w.w2 = mc::ExpertLinear::bf16_stacked(w.b2.data(), L, I);
    w.gate_up_bytes = 2.0 * double(n) * 2;
    w.down_bytes = double(n) * 2;
  } else {
    cuda::DeviceBuffer<uint8_t>* ps[3] = {&w.p1, &w.p3, &w.p2};
    cuda::DeviceBuffer<uint8_t>* ss[3] = {&w.s1, &w.s3, &w.s2};
    for (int i = 0; i < 3; ++i) {
      *ps[i] = cuda::DeviceBuffer<uint8_t>(static_cast<size_t>(n / 2));
      *ss[i] = cuda::DeviceBuffer<uint8_t>(static_cast<size_t>(n / 32));
      mc::fill_random_u8(ps[i]->data(), n / 2, 0, 255, 21 + i);
      mc::fill_random_u8(ss[i]->data(), n / 32, 118, 121, 31 + i);
    }
    w.w1 = mc::ExpertLinear::mxfp4_stacked(w.p1.data(), w.s1.data(), I, L);
    w.w3 = mc::ExpertLinear::mxfp4_stacked(w.p3.data(), w.s3.data(), I, L);
    w.w2 = mc::ExpertLinear::mxfp4_stacked(w.p2.data(), w.s2.data(), L, I);
    w.gate_up_bytes = 2.0 * double(n) * (0.5 + 1.0 / 32);
    w.down_bytes = double(n) * (0.5 + 1.0 / 32);
  }
}

// K distinct experts per token, uniform.
std::vector<int32_t> uniform_routing(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::vector<int32_t> idx(static_cast<size_t>(T * K)), pool(static_cast<size_t>(E));
  std::iota(pool.begin(), pool.end(), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t j = k + int64_t(r() % uint64_t(E - k));
      std::swap(pool[static_cast<size_t>(k)], pool[static_cast<size_t>(j)]);
      idx[static_cast<size_t>(t * K + k)] = pool[static_cast<size_t>(k)];
    }
  return idx;
}

void row(const char* fmt, int64_t T, const char* op, double flops, float ms, float cublas_ms, double wbytes,
         double bw) {
  const double tf = flops / (ms * 1e-3) / 1e12, tc = flops / (cublas_ms * 1e-3) / 1e12;
  std::printf(
      "%-20s T=%-6lld %-8s %9.3f ms %7.1f TFLOP/s | cuBLAS %9.3f ms %7.1f TFLOP/s | ratio %5.1f%% | weights %6.2f GB, "
      "%7.3f ms at copy bw\n",
      fmt, (long long)T, op, ms, tf, cublas_ms, tc, 100.0 * tf / tc, wbytes / 1e9, wbytes / (bw * 1e9) * 1e3);
}

}  // namespace
#endif

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  CLI::App app{"Grouped MoE expert GEMMs vs cuBLAS (see the header of bench/bench_cuda_moe.cpp)"};
  std::string config = "configs/kimi-k3.json", tokens_s = "4096,16384";
  int reps = 5;
  int64_t experts_override = 0;
  app.add_option("--config", config, "config.json giving the MoE sizes");
  app.add_option("--tokens", tokens_s, "comma-separated token counts");
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--experts", experts_override, "override num_experts (fewer experts: less memory)");
  std::string formats_s = "bf16,mxfp4", tm_s = "128,64", variants_s = "default,mma.sync";
  app.add_option("--formats", formats_s, "weight formats to time: bf16, mxfp4 (comma-separated)");
  app.add_option("--tm", tm_s, "tile heights to time (comma-separated, 128 and/or 64)");
  app.add_option("--variants", variants_s,
                 "GEMM configurations to time, comma-separated: default, or parts joined by '+' (mma.sync, "
                 "row-major, no-skip, narrow, ctas=N, static)");
  CLI11_PARSE(app, argc, argv);
  std::vector<mc::GemmConfig> variants;  // checked before the GPU, so a bad name fails on any machine
  try {
    for (size_t i = 0; i <= variants_s.size();) {
      const size_t j = std::min(variants_s.find(',', i), variants_s.size());
      variants.push_back(mc::parse_gemm_config(variants_s.substr(i, j - i)));
      i = j + 1;
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda_moe: --variants: %s\n", e.what());
    return 1;
  }

  std::string why;
  if (!cuda::available(&why)) {
    std::printf("bench_cuda_moe: no GPU (%s); nothing to measure\n", why.c_str());
    return 0;
  }
#ifdef K3_HAVE_CUDA
  try {
    std::printf("device: %s\n", cuda::device_summary().c_str());
    const K3Config c = load_config(config);
    const int64_t E = experts_override > 0 ? experts_override : c.num_experts, K = c.num_experts_per_token;
    const int64_t L = c.routed_expert_hidden_size, I = c.moe_intermediate_size;
    const std::vector<int32_t> tokens = cli::parse_ids(tokens_s, "--tokens");
    const std::vector<int32_t> tms = cli::parse_ids(tm_s, "--tm");
    const bool want_bf16 = formats_s.find("bf16") != std::string::npos;
    const bool want_mx = formats_s.find("mxfp4") != std::string::npos;
    const int64_t Tmax = *std::max_element(tokens.begin(), tokens.end());
    const GluParams glu{c.hidden_act == Activation::SiTU, c.situ_beta, c.situ_linear_beta};
    std::printf("config %s: E=%lld top-%lld latent L=%lld intermediate I=%lld; reps %d (median)\n", config.c_str(),
                (long long)E, (long long)K, (long long)L, (long long)I, reps);
    const double bw = copy_bandwidth_gbs();
    std::printf("device-to-device copy: %.0f GB/s (bytes read + written)\n", bw);

    cublasHandle_t h;
    BENCH_CUBLAS(cublasCreate(&h));
    const int64_t Smax = Tmax * K;
    cuda::DeviceBuffer<uint16_t> z(static_cast<size_t>(Tmax * L)), hbuf(static_cast<size_t>(Smax * I)),
        ybuf(static_cast<size_t>(Smax * L));
    cuda::DeviceBuffer<float> wts(static_cast<size_t>(Smax)), u(static_cast<size_t>(Tmax * L));
    cuda::DeviceBuffer<int32_t> idx(static_cast<size_t>(Smax));
    mc::fill_random_bf16(z.data(), Tmax * L, 1.7f, 5);
    mc::Dispatch d(Tmax, E, K);
    {
      // cuBLAS operands: A [S, max(L, I)], B [2I or L, max(L, I)], C [S, 2I]
      const int64_t kmax = std::max(L, I);
      cuda::DeviceBuffer<uint16_t> ca(static_cast<size_t>(Smax * kmax)), cb(static_cast<size_t>(2 * I * kmax)),
          cc(static_cast<size_t>(Smax * 2 * I));
      mc::fill_random_bf16(ca.data(), Smax * kmax, 1.0f, 6);
      mc::fill_random_bf16(cb.data(), 2 * I * kmax, 0.03f, 7);
      std::vector<std::vector<float>> cublas_ms;  // [token case] = {gate_up, down}
      for (int32_t T : tokens) {
        const int64_t S = int64_t(T) * K;
        const float gu = median_ms([&] { cublas_nt(h, cc.data(), ca.data(), cb.data(), S, 2 * I, L); }, reps);
        const float dn = median_ms([&] { cublas_nt(h, cc.data(), ca.data(), cb.data(), S, L, I); }, reps);
        cublas_ms.push_back({gu, dn});
      }
      for (int fmt = 0; fmt < 2; ++fmt) {
        if ((fmt == 0 && !want_bf16) || (fmt == 1 && !want_mx)) continue;
        Weights w;
        make_weights(w, fmt == 1, E, L, I);
        const char* name = fmt == 1 ? "MXFP4" : "bf16";
        for (size_t ti = 0; ti < tokens.size(); ++ti) {
          const int64_t T = tokens[ti], S = T * K;
          const std::vector<int32_t> hidx = uniform_routing(T, E, K, 77 + uint64_t(T));
          idx.upload(hidx.data(), hidx.size());
          std::vector<float> hw(static_cast<size_t>(S), 1.0f / float(K));
          wts.upload(hw.data(), hw.size());
          d.build(idx.data(), T);
          const int auto_tm = d.tile_m();
          for (const mc::GemmConfig& var : variants)
            for (int tm : tms) {
              const bool mma = var.kernel == mc::GemmConfig::Kernel::kMmaSync;
              if (mma && (fmt == 1 || tm != 128)) continue;  // the mma.sync kernel either way
              d.build(idx.data(), T, tm);
              const double fgu = 2.0 * double(S) * double(2 * I) * double(L),
                           fdn = 2.0 * double(S) * double(L) * double(I);
              const float tgu =
                  median_ms([&] { mc::expert_gate_up(hbuf.data(), z.data(), d, w.w1, w.w3, glu, var); }, reps);
              const float tdn = median_ms([&] { mc::expert_down(ybuf.data(), hbuf.data(), d, w.w2, var); }, reps);
              const float tall = median_ms(
                  [&] {
                    mc::experts_forward(u.data(), hbuf.data(), ybuf.data(), z.data(), wts.data(), d, w.w1, w.w3, w.w2,
                                        glu, var);
                  },
                  reps);
              const std::vector<float>& cb_ms = cublas_ms[ti];
              const std::string vname = mc::gemm_config_name(var);
              const std::string tag = std::string(name) + (vname == "default" ? "" : " " + vname) + " TM" +
                                      std::to_string(tm) + (tm == auto_tm ? "*" : "");
              row(tag.c_str(), T, "gate_up", fgu, tgu, cb_ms[0], w.gate_up_bytes, bw);
              row(tag.c_str(), T, "down", fdn, tdn, cb_ms[1], w.down_bytes, bw);
              row(tag.c_str(), T, "experts", fgu + fdn, tall, cb_ms[0] + cb_ms[1], w.gate_up_bytes + w.down_bytes, bw);
            }
        }
      }
    }
    cublasDestroy(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_moe: %s\n", e.what());
    return 1;
  }
#endif
  return 0;
}
