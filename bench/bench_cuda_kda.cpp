// KDA chunked forward on the GPU (kernels/kda/kda_cuda.h): time at the ANCHORS.md shapes, and a check
// against the CPU twin at one small shape.
//
//   build/bench_cuda_kda [--reps 30] [--warmup 5] [--shapes BxTxH,...]
//
// Each time is the median of --reps runs (after --warmup), measured with CUDA events around one
// kda_chunk_forward call (prepare + recurrence kernels), bf16 q/k/v/o, fp32 g/beta/state. Inputs are
// several times the 50 MB L2 at every shape, so no flush is needed. Columns:
//   ms        median time
//   TFLOP/s   algorithmic FLOPs of the C = 16 chunked form / time. Per (chunk, head): A and M 2*(2*16*16*128),
//             Mw 2*16^3, Kw and Qw 2*(2*16*16*128), [Qw;Kw] S 2*(2*16*128^2), the V terms 2*(2*16*16*128), the
//             state update 2*16*128^2: 1.974 MFLOP (the hi/lo split products the kernels also run are not counted)
//   GB/s      bytes that must move / time: q, k, v, o bf16 and g fp32 per token-head (1,536 B), plus the
//             workspace written once and read once per value slice (13,824 B per chunk-head each way)
//   slices    CTAs per head of the recurrence kernel (value-column slices)
//   kw        warps per 16 value columns of the recurrence kernel (key split, kda_chunk_key_warps)
//   prepare / recur. ms   each kernel alone (KdaParams::stage), median as above
//   ms, uncapped / prep, uncapped / ms, 7 CTAs / prep, 7 CTAs   the whole forward and the prepare kernel
//             with the prepare kernel's other register caps (KdaParams::prepare_cap), in the same run:
//             kUncapped = no cap, k7Ctas = capped for 7 CTAs per SM instead of 8 (kda_cuda_chunk.cu)
// --shapes BxTxH,... times only those shapes (e.g. one shape under a profiler).
// Reference times of fla's chunk_kda and FlashKDA at these shapes: ANCHORS.md; ours and fla's measured in
// the same run: docs/BENCHMARKS.md. Exits 0 with a message when there is no GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/splitmix.h"
#include "kernels/kda/kda.h"
#include "kernels/kda/kda_cuda.h"

namespace kc = k3::kda::cuda;
using k3::DType;
using k3::cuda::DeviceBuffer;

namespace {

constexpr int D = 128;

// splitmix64 -> uniform [0, 1): fast enough to fill a few hundred million inputs.
using Rng = k3::SplitMixUniform;

struct Inputs {
  int64_t B, T, H;
  std::vector<float> q, k, v, g, beta;  // q, k L2-normalised per head; all exactly bf16 values except g, beta
};

Inputs make_inputs(int64_t B, int64_t T, int64_t H, uint64_t seed) {
  Inputs in{B, T, H, {}, {}, {}, {}, {}};
  Rng rng{seed};
  const size_t n = size_t(B * T * H * D);
  for (auto* x : {&in.q, &in.k, &in.v}) {
    x->resize(n);
    for (auto& e : *x) e = float(2.0 * rng.next() - 1.0);
  }
  for (auto* x : {&in.q, &in.k})
    for (size_t r = 0; r < n / D; ++r) {
      double ss = 0;
      for (int d = 0; d < D; ++d) ss += double((*x)[r * D + d]) * (*x)[r * D + d];
      const double inv = 1.0 / std::sqrt(ss + 1e-6);
      for (int d = 0; d < D; ++d) (*x)[r * D + d] = k3::bf16_to_f32(k3::f32_to_bf16(float((*x)[r * D + d] * inv)));
    }
  for (auto& e : in.v) e = k3::bf16_to_f32(k3::f32_to_bf16(e));
  in.g.resize(n);
  for (auto& e : in.g) e = float(-5.0 * rng.next());
  in.beta.resize(size_t(B * T * H));
  for (auto& e : in.beta) e = float(0.05 + 0.9 * rng.next());
  return in;
}

std::vector<uint16_t> bf16(const std::vector<float>& v) {
  std::vector<uint16_t> u(v.size());
  for (size_t i = 0; i < v.size(); ++i) u[i] = k3::f32_to_bf16(v[i]);
  return u;
}

struct Device {
  DeviceBuffer<uint16_t> q, k, v, o;
  DeviceBuffer<float> g, beta, state;
  DeviceBuffer<unsigned char> ws;
  kc::KdaParams p;
};

void upload(Device& d, const Inputs& in) {
  const size_t n = in.q.size();
  d.q = DeviceBuffer<uint16_t>(bf16(in.q).data(), n);
  d.k = DeviceBuffer<uint16_t>(bf16(in.k).data(), n);
  d.v = DeviceBuffer<uint16_t>(bf16(in.v).data(), n);
  d.o = DeviceBuffer<uint16_t>(n);
  d.g = DeviceBuffer<float>(in.g.data(), n);
  d.beta = DeviceBuffer<float>(in.beta.data(), in.beta.size());
  d.state = DeviceBuffer<float>(size_t(in.B * in.H * D * D));
  const size_t wsb = kc::kda_chunk_workspace_bytes(in.B, in.T, in.H, DType::BF16);
  d.ws = DeviceBuffer<unsigned char>(wsb);
  kc::KdaParams& p = d.p;
  p.B = in.B;
  p.T = in.T;
  p.H = in.H;
  p.scale = 1.0f / std::sqrt(float(D));
  p.in_dtype = p.out_dtype = DType::BF16;
  p.q = d.q.data();
  p.k = d.k.data();
  p.v = d.v.data();
  p.g = d.g.data();
  p.beta = d.beta.data();
  p.state_in = nullptr;  // a fresh sequence
  p.state_out = d.state.data();
  p.o = d.o.data();
  p.workspace = d.ws.data();
  p.workspace_bytes = wsb;
}

float median_ms(const std::function<void()>& f, int warmup, int reps) {
  return k3::cuda::median_ms([&](int) { f(); }, reps, warmup);
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is measured, also into a pipe
  int reps = 30, warmup = 5;
  std::string only;  // --shapes BxTxH,...: only these (default: the ANCHORS.md shapes)
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 < argc && !std::strcmp(argv[i], "--reps")) reps = std::max(1, std::atoi(argv[i + 1]));
    else if (i + 1 < argc && !std::strcmp(argv[i], "--warmup")) warmup = std::max(0, std::atoi(argv[i + 1]));
    else if (i + 1 < argc && !std::strcmp(argv[i], "--shapes")) only = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: bench_cuda_kda [--reps N] [--warmup N] [--shapes BxTxH,...]\n");
      return 2;
    }
  }
  struct Shape {
    int64_t B, T, H;
    double fla_ms;
  };
  std::vector<Shape> shapes = {
      {1, 8192, 64, 1.76}, {1, 8192, 96, 2.60}, {4, 4096, 32, 1.69}, {1, 32768, 32, 4.15}, {1, 65536, 16, 4.43}};
  if (!only.empty()) {
    shapes.clear();
    for (size_t pos = 0; pos < only.size();) {
      size_t end = only.find(',', pos);
      if (end == std::string::npos) end = only.size();
      long long B = 0, T = 0, H = 0;
      if (std::sscanf(only.substr(pos, end - pos).c_str(), "%lldx%lldx%lld", &B, &T, &H) != 3 || B < 1 || T < 1 ||
          H < 1) {
        std::fprintf(stderr, "bench_cuda_kda: --shapes wants BxTxH,... (positive), got '%s'\n", only.c_str());
        return 2;
      }
      shapes.push_back({B, T, H, NAN});
      pos = end + 1;
    }
  }
  std::string why;
  if (!k3::cuda::available(&why)) {
    std::printf("bench_cuda_kda: no usable GPU (%s); nothing to measure.\n", why.c_str());
    return 0;
  }
  std::printf("%s\n", k3::cuda::device_summary().c_str());
  std::printf("KDA chunk forward (C = 16), bf16 q/k/v/o, fp32 g/beta/state; median of %d after %d warm-up\n", reps,
              warmup);

  // Check against the CPU twin first (B2 T300 H2: partial last chunk, two sequences).
  {
    const Inputs in = make_inputs(2, 300, 2, 1);
    Device d;
    upload(d, in);
    kc::kda_chunk_forward(d.p);
    k3::cuda::synchronize();
    std::vector<uint16_t> ob(in.q.size());
    d.o.download(ob.data(), ob.size());
    std::vector<float> o(ob.size()), ref(in.q.size());
    for (size_t i = 0; i < o.size(); ++i) o[i] = k3::bf16_to_f32(ob[i]);
    const size_t sx = size_t(in.T * in.H * D);
    for (int64_t b = 0; b < in.B; ++b) {
      std::vector<double> st(size_t(in.H * D * D), 0.0);
      k3::kda::kda_recurrent_forward(ref.data() + b * sx, in.q.data() + b * sx, in.k.data() + b * sx,
                                     in.v.data() + b * sx, in.g.data() + b * sx, in.beta.data() + b * in.T * in.H,
                                     d.p.scale, st.data(), in.T, in.H, D, D);
    }
    std::printf("check vs CPU recurrence (B2 T300 H2): rel L2 of o = %.3g (bf16 bound 1e-2)\n\n", rel_l2(o, ref));
  }

  std::printf("%-22s %9s %9s %9s %7s %5s %12s %12s %12s %14s %12s %12s %12s\n", "shape (B, T, H)", "ms", "TFLOP/s",
              "GB/s", "slices", "kw", "prepare ms", "recur. ms", "ms, uncapped", "prep, uncapped", "ms, 7 CTAs",
              "prep, 7 CTAs", "fla fwd ms");
  for (const Shape& s : shapes) {
    const Inputs in = make_inputs(s.B, s.T, s.H, 42);
    Device d;
    upload(d, in);
    const float ms = median_ms([&] { kc::kda_chunk_forward(d.p); }, warmup, reps);
    kc::KdaParams pp = d.p, pr = d.p;
    pp.stage = kc::KdaParams::Stage::kPrepareOnly;
    pr.stage = kc::KdaParams::Stage::kRecurrenceOnly;
    const float ms_prep = median_ms([&] { kc::kda_chunk_forward(pp); }, 2, reps);
    const float ms_rec = median_ms([&] { kc::kda_chunk_forward(pr); }, 2, reps);
    // The prepare kernel's other register caps (kUncapped, k7Ctas), same run.
    using Cap = kc::KdaParams::PrepareCap;
    const Cap caps[2] = {Cap::kUncapped, Cap::k7Ctas};
    float ms_v[2], ms_prep_v[2];
    for (int i = 0; i < 2; ++i) {
      kc::KdaParams pa = d.p, pc = pp;
      pa.prepare_cap = pc.prepare_cap = caps[i];
      ms_v[i] = median_ms([&] { kc::kda_chunk_forward(pa); }, 2, reps);
      ms_prep_v[i] = median_ms([&] { kc::kda_chunk_forward(pc); }, 2, reps);
    }
    const double chunk_heads = double(s.B) * double((s.T + 15) / 16) * double(s.H);
    const double flop = chunk_heads * 1974272.0;
    const int slices = kc::kda_chunk_value_slices(s.B, s.H, DType::BF16);
    const int kw = kc::kda_chunk_key_warps(s.B, s.H, DType::BF16);
    const double bytes = double(s.B * s.T * s.H) * 1536.0 + chunk_heads * 13824.0 * (1 + slices);
    char name[64];
    std::snprintf(name, sizeof name, "(%lld, %lld, %lld)", (long long)s.B, (long long)s.T, (long long)s.H);
    std::printf("%-22s %9.3f %9.1f %9.0f %7d %5d %12.3f %12.3f %12.3f %14.3f %12.3f %12.3f %12.2f\n", name, ms,
                flop / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9, slices, kw, ms_prep, ms_rec, ms_v[0],
                ms_prep_v[0], ms_v[1], ms_prep_v[1], s.fla_ms);
  }

  // Decode: one token through the fused recurrence (state 64 KB per head read and written).
  std::printf("\n%-22s %9s %9s\n", "decode step (B, H)", "us", "GB/s");
  for (auto [B, H] : {std::pair<int64_t, int64_t>{1, 96}, {16, 96}, {64, 96}}) {
    const Inputs in = make_inputs(B, 1, H, 7);
    Device d;
    upload(d, in);
    d.p.state_in = d.state.data();
    const float ms = median_ms([&] { kc::kda_recurrent_forward(d.p); }, warmup, reps);
    char name[64];
    std::snprintf(name, sizeof name, "(%lld, %lld)", (long long)B, (long long)H);
    std::printf("%-22s %9.1f %9.0f\n", name, ms * 1e3, double(B * H) * D * D * 4 * 2 / (ms * 1e-3) / 1e9);
  }
  return 0;
}
