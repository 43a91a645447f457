// The KDA CUDA kernels (src/kernels/kda/kda_cuda.h) against their CPU twins (kda.h) on random inputs of
// awkward sizes. Every test skips without a Hopper GPU.
//
// Tolerances (relative L2 over the whole output, non-finite values fail first, util/compare.h):
//   fp32 elementwise kernels     1e-6   (fp32 rounding of a few operations; the CPU sums squares in double)
//   bf16 anything                1e-2   (one bf16 rounding is <= 2^-9 = 2e-3 relative; the brief's bound)
//   fp32 recurrence (GPU)        1e-5   (fp32 state vs the CPU's fp64 state, ~6e-8 per operation, contractive)
//   fp32 chunked form (GPU)      1e-4   (every product is hi*hi + hi*lo + lo*hi of bf16 halves: ~2^-16 = 1.5e-5
//                                        relative per product; 1e-4 allows the 16-step solve and the chain of
//                                        chunks a factor ~6 over one product)
// The CPU side always gets the same (bf16-rounded, where the GPU reads bf16) inputs, so an error measures the
// kernel, not the input rounding. The KDA-core tests run at every head dim the kernels take, D = 128 (K3),
// 64 (k3-small, k3-1b) and 32 (k3-tiny), with the same tolerances.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/kda/kda.h"
#include "kernels/kda/kda_cuda.h"
#include "util/compare.h"
#include "util/cuda_test.h"

namespace {

namespace kc = k3::kda::cuda;
using k3::DType;
using k3::cuda::DeviceBuffer;
using Vec = std::vector<float>;
using U16 = std::vector<uint16_t>;
constexpr int kK3HeadDim = 128;
constexpr int kHeadDims[] = {128, 64, 32};
constexpr double kBf16Tol = 1e-2, kF32Tol = 1e-6, kRecF32Tol = 1e-5, kChunkF32Tol = 1e-4;

// Seed offset per head dim: 0 at D = 128 (the inputs the D = 128 tests always had).
uint32_t dseed(int D) { return D == kK3HeadDim ? 0u : 1000u * uint32_t(D); }

Vec normal(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
U16 to_bf16(const Vec& v) {
  U16 u(v.size());
  for (size_t i = 0; i < v.size(); ++i) u[i] = k3::f32_to_bf16(v[i]);
  return u;
}
Vec from_bf16(const U16& u) {
  Vec v(u.size());
  for (size_t i = 0; i < u.size(); ++i) v[i] = k3::bf16_to_f32(u[i]);
  return v;
}
Vec round_bf16(const Vec& v) { return from_bf16(to_bf16(v)); }
double rel(const Vec& a, const Vec& b) { return k3test::rel_l2(a, b); }
bool all_finite(const Vec& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}
template <class T>
std::vector<T> download(const DeviceBuffer<T>& d, size_t n) {
  std::vector<T> h(n);
  d.download(h.data(), n);
  return h;
}

// ---------------------------------------------------------------------------------------------------------
// KDA inputs for B sequences of head dim D: q, k L2-normalised, g in [-5, 0] drawn per token from four modes
// (all at the bound, near 0, uniform, per-channel mix), beta in (0.01, 0.99), a nonzero initial state. With
// bf16 = true q, k, v are rounded to bf16 (the values both sides see).
struct Case {
  int64_t B, T, H;
  Vec q, k, v, g, beta, state0;  // state0: [B][H][D][D]
  int D = kK3HeadDim;
  float scale = 1.0f / std::sqrt(float(kK3HeadDim));
};

Case make_case(int64_t B, int64_t T, int64_t H, uint32_t seed, bool bf16, bool all_at_bound = false,
               int D = kK3HeadDim) {
  std::mt19937 rng(seed);
  Case c{B, T, H, {}, {}, {}, {}, {}, {}};
  c.D = D;
  c.scale = 1.0f / std::sqrt(float(D));
  const size_t n = size_t(B * T * H * D);
  c.q = normal(rng, n);
  c.k = normal(rng, n);
  c.v = normal(rng, n);
  for (Vec* x : {&c.q, &c.k})
    for (size_t r = 0; r < n / D; ++r) {
      double ss = 0;
      for (int d = 0; d < D; ++d) ss += double((*x)[r * D + d]) * (*x)[r * D + d];
      for (int d = 0; d < D; ++d) (*x)[r * D + d] = float((*x)[r * D + d] / std::sqrt(ss));
    }
  if (bf16) {
    c.q = round_bf16(c.q);
    c.k = round_bf16(c.k);
    c.v = round_bf16(c.v);
  }
  std::uniform_int_distribution<int> mode(0, 3);
  std::uniform_real_distribution<float> unif(-5.0f, 0.0f), near0(-1e-3f, 0.0f), b(0.01f, 0.99f);
  auto draw = [&](int m) { return m == 0 ? -5.0f : m == 1 ? near0(rng) : unif(rng); };
  c.g.resize(n);
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int m = all_at_bound ? 0 : mode(rng);
    for (int64_t i = 0; i < H * D; ++i) c.g[bt * H * D + i] = draw(m == 3 ? mode(rng) % 3 : m);
  }
  c.beta.resize(size_t(B * T * H));
  for (auto& x : c.beta) x = b(rng);
  c.state0 = normal(rng, size_t(B * H * D * D), 0.5f);
  return c;
}

struct Result {
  Vec o, state;
};

// The CPU twin, sequence by sequence (the recurrence, or the chunked form for long inputs).
Result cpu_ref(const Case& c, bool chunked = false) {
  const int64_t D = c.D;
  Result r{Vec(c.q.size()), Vec(c.state0.size())};
  const size_t sx = size_t(c.T * c.H * D), ss = size_t(c.H * D * D), sb = size_t(c.T * c.H);
  for (int64_t b = 0; b < c.B; ++b) {
    std::vector<double> st(c.state0.begin() + b * ss, c.state0.begin() + (b + 1) * ss);
    if (chunked)
      k3::kda::kda_chunk_forward(r.o.data() + b * sx, c.q.data() + b * sx, c.k.data() + b * sx, c.v.data() + b * sx,
                                 c.g.data() + b * sx, c.beta.data() + b * sb, c.scale, st.data(), c.T, c.H, D, D, 64);
    else
      k3::kda::kda_recurrent_forward(r.o.data() + b * sx, c.q.data() + b * sx, c.k.data() + b * sx, c.v.data() + b * sx,
                                     c.g.data() + b * sx, c.beta.data() + b * sb, c.scale, st.data(), c.T, c.H, D, D);
    for (size_t i = 0; i < ss; ++i) r.state[b * ss + i] = float(st[i]);
  }
  return r;
}

// The GPU: chunked (kda_chunk_forward, its prepare kernel under register cap `cap`) or recurrent
// (kda_recurrent_forward), bf16 or fp32 q/k/v and o. The output buffer carries 64 guard elements
// after the end, checked untouched (no write past T).
Result gpu_run(const Case& c, bool chunked, DType in, DType out,
               kc::KdaParams::PrepareCap cap = kc::KdaParams::PrepareCap::kAuto) {
  const size_t n = c.q.size();
  DeviceBuffer<float> g(c.g.data(), n), beta(c.beta.data(), c.beta.size()), st(c.state0.data(), c.state0.size());
  DeviceBuffer<uint16_t> qb, kb, vb;
  DeviceBuffer<float> qf, kf, vf;
  kc::KdaParams p;
  p.B = c.B;
  p.T = c.T;
  p.H = c.H;
  p.D = c.D;
  p.scale = c.scale;
  p.in_dtype = in;
  p.out_dtype = out;
  p.prepare_cap = cap;
  if (in == DType::BF16) {
    qb = DeviceBuffer<uint16_t>(to_bf16(c.q).data(), n);
    kb = DeviceBuffer<uint16_t>(to_bf16(c.k).data(), n);
    vb = DeviceBuffer<uint16_t>(to_bf16(c.v).data(), n);
    p.q = qb.data();
    p.k = kb.data();
    p.v = vb.data();
  } else {
    qf = DeviceBuffer<float>(c.q.data(), n);
    kf = DeviceBuffer<float>(c.k.data(), n);
    vf = DeviceBuffer<float>(c.v.data(), n);
    p.q = qf.data();
    p.k = kf.data();
    p.v = vf.data();
  }
  p.g = g.data();
  p.beta = beta.data();
  p.state_in = st.data();
  p.state_out = st.data();
  constexpr size_t kGuard = 64;
  constexpr uint16_t kSentinel = 0x7fc1;  // a NaN pattern in both halves of an fp32 word
  DeviceBuffer<uint16_t> ob16;
  DeviceBuffer<float> of32;
  if (out == DType::BF16) {
    ob16 = DeviceBuffer<uint16_t>(U16(n + kGuard, kSentinel).data(), n + kGuard);
    p.o = ob16.data();
  } else {
    of32 = DeviceBuffer<float>(n + kGuard);
    std::vector<uint16_t> s(2 * (n + kGuard), kSentinel);
    k3::cuda::copy_to_device(of32.data(), s.data(), s.size() * 2);
    p.o = of32.data();
  }
  DeviceBuffer<unsigned char> ws;
  if (chunked) {
    const size_t bytes = kc::kda_chunk_workspace_bytes(c.B, c.T, c.H, in, c.D);
    ws = DeviceBuffer<unsigned char>(bytes);
    p.workspace = ws.data();
    p.workspace_bytes = bytes;
    kc::kda_chunk_forward(p);
  } else {
    kc::kda_recurrent_forward(p);
  }
  k3::cuda::synchronize();
  Result r;
  if (out == DType::BF16) {
    const U16 all = download(ob16, n + kGuard);
    for (size_t i = n; i < n + kGuard; ++i) EXPECT_EQ(all[i], kSentinel) << "write past the end at " << i - n;
    r.o = from_bf16(U16(all.begin(), all.begin() + n));
  } else {
    std::vector<uint16_t> all(2 * (n + kGuard));
    k3::cuda::copy_to_host(all.data(), of32.data(), all.size() * 2);
    for (size_t i = 2 * n; i < all.size(); ++i) EXPECT_EQ(all[i], kSentinel) << "write past the end";
    r.o = download(of32, n);
  }
  r.state = download(st, c.state0.size());
  return r;
}

std::string name(const Case& c) {
  return "B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
         " D=" + std::to_string(c.D);
}

// got against ref, o and the state, both within tol; prints "[label] rel L2: o .., state ..".
void expect_close(const Result& got, const Result& ref, double tol, const std::string& label) {
  const double eo = rel(got.o, ref.o), es = rel(got.state, ref.state);
  std::printf("[%s] rel L2: o %.3g, state %.3g\n", label.c_str(), eo, es);
  EXPECT_LE(eo, tol) << label;
  EXPECT_LE(es, tol) << label;
}

// ---------------------------------------------------------------------------------------------------------
TEST(CudaKdaChunk, Bf16MatchesCpuRecurrence) {
  K3_REQUIRE_GPU();
  const int64_t shapes[][3] = {{1, 1, 1}, {2, 15, 3}, {1, 16, 2}, {2, 17, 3}, {3, 100, 2}, {1, 257, 5}, {2, 64, 1}};
  for (int D : kHeadDims) {
    for (const auto& s : shapes) {
      const Case c = make_case(s[0], s[1], s[2], 100 + uint32_t(s[1]) + dseed(D), true, false, D);
      const Result ref = cpu_ref(c);
      for (DType out : {DType::BF16, DType::F32}) {
        expect_close(gpu_run(c, true, DType::BF16, out), ref, kBf16Tol,
                     std::string("chunk bf16 -> ") + k3::dtype_name(out) + ", " + name(c));
      }
    }
  }
}

// The swizzle of the workspace tiles (kda_cuda.h), on the CPU: a permutation of each row that keeps
// 8-element pieces whole, and the 8 rows ldmatrix reads at one piece (rows 8i .. 8i+7) land in 8 distinct
// 16-byte bank groups (byte address / 16 mod 8) once the tile sits in shared memory unpadded.
TEST(CudaKdaChunk, WorkspaceSwizzleIsAConflictFreePermutation) {
  for (const int width : {16, 32, 64, 128}) {
    for (int row = 0; row < 16; ++row) {
      std::vector<int> hit(size_t(width), 0);
      for (int col = 0; col < width; ++col) {
        const int idx = kc::kda_ws_tile_index(row, col, width);
        ASSERT_GE(idx, row * width);
        ASSERT_LT(idx, (row + 1) * width) << "width " << width << " row " << row << " col " << col;
        ++hit[size_t(idx - row * width)];
        EXPECT_EQ(idx % 8, col % 8) << "pieces stay whole";
      }
      for (int x : hit) ASSERT_EQ(x, 1) << "width " << width << " row " << row;
    }
    for (int r0 : {0, 8})
      for (int col = 0; col < width; col += 8) {
        std::vector<int> groups;
        for (int rr = 0; rr < 8; ++rr) groups.push_back(kc::kda_ws_tile_index(r0 + rr, col, width) * 2 / 16 % 8);
        std::sort(groups.begin(), groups.end());
        EXPECT_EQ(std::unique(groups.begin(), groups.end()), groups.end())
            << "width " << width << " rows " << r0 << "+ col " << col;
      }
  }
}

// KdaParams::prepare_cap kUncapped and k7Ctas (the prepare kernel without its register cap, or with a
// looser one, for the benchmark) are the same code under another register budget: the same bits, bf16
// and fp32 inputs, every head dim.
TEST(CudaKdaChunk, PrepareVariantIsBitwiseEqual) {
  K3_REQUIRE_GPU();
  using Cap = kc::KdaParams::PrepareCap;
  const std::pair<Cap, const char*> caps[] = {{Cap::kUncapped, "uncapped"}, {Cap::k7Ctas, "7 CTAs"}};
  for (int D : kHeadDims)
    for (bool bf16 : {true, false}) {
      const Case c = make_case(2, 77, 3, 300 + dseed(D), bf16, false, D);
      const DType in = bf16 ? DType::BF16 : DType::F32;
      const Result a = gpu_run(c, true, in, DType::F32);
      for (const auto& [cap, cap_name] : caps) {
        const Result b = gpu_run(c, true, in, DType::F32, cap);
        EXPECT_EQ(a.o, b.o) << name(c) << (bf16 ? " bf16" : " fp32") << " prepare cap " << cap_name;
        EXPECT_EQ(a.state, b.state) << name(c) << (bf16 ? " bf16" : " fp32") << " prepare cap " << cap_name;
      }
    }
}

TEST(CudaKdaChunk, Fp32MatchesCpuRecurrenceTightly) {
  K3_REQUIRE_GPU();
  const int64_t shapes[][3] = {{1, 1, 1}, {2, 17, 3}, {3, 100, 2}, {1, 257, 4}};
  for (int D : kHeadDims) {
    for (const auto& s : shapes) {
      const Case c = make_case(s[0], s[1], s[2], 200 + uint32_t(s[1]) + dseed(D), false, false, D);
      const Result ref = cpu_ref(c);
      expect_close(gpu_run(c, true, DType::F32, DType::F32), ref, kChunkF32Tol, "chunk fp32, " + name(c));
      // bf16 output of the fp32 path: one rounding of o.
      const Result gb = gpu_run(c, true, DType::F32, DType::BF16);
      EXPECT_LE(rel(gb.o, ref.o), kBf16Tol) << name(c);
    }
  }
}

TEST(CudaKdaRecurrent, MatchesCpuRecurrence) {
  K3_REQUIRE_GPU();
  const int64_t shapes[][3] = {{1, 1, 1}, {2, 37, 3}, {1, 100, 2}};
  for (int D : kHeadDims) {
    for (const auto& s : shapes) {
      for (bool bf16 : {false, true}) {
        const Case c = make_case(s[0], s[1], s[2], 300 + uint32_t(s[1]) + dseed(D), bf16, false, D);
        const Result ref = cpu_ref(c);
        const DType dt = bf16 ? DType::BF16 : DType::F32;
        const Result got = gpu_run(c, false, dt, dt);
        const double eo = rel(got.o, ref.o), es = rel(got.state, ref.state);
        std::printf("[recurrent %s, %s] rel L2: o %.3g, state %.3g\n", k3::dtype_name(dt), name(c).c_str(), eo, es);
        EXPECT_LE(eo, bf16 ? kBf16Tol : kRecF32Tol) << name(c);
        EXPECT_LE(es, kRecF32Tol) << name(c);  // the state is fp32 either way, from the same inputs
      }
    }
  }
}

// The recurrence with the gate, beta's sigmoid and the gated output norm fused (KdaGateNorm) against the four
// launches, bit for bit: outputs and states, fp32 and bf16, every head dim, sequences in scrambled pool places.
template <class T>
void gate_norm_fused_matches(int D, int64_t Tn, std::mt19937& rng) {
  const int64_t B = 3, H = 4, HD = H * D, rows = B * Tn, places = 5;
  const std::vector<int32_t> slot = {3, 0, 4};
  constexpr DType dt = std::is_same_v<T, float> ? DType::F32 : DType::BF16;
  auto act = [&](const Vec& v) {
    if constexpr (std::is_same_v<T, float>) return DeviceBuffer<float>(v.data(), v.size());
    else return DeviceBuffer<uint16_t>(to_bf16(v).data(), v.size());
  };
  const Vec q = normal(rng, size_t(rows * HD), 0.2f), k = normal(rng, size_t(rows * HD), 0.2f);
  const Vec v = normal(rng, size_t(rows * HD)), z = normal(rng, size_t(rows * HD), 2.0f);
  const Vec gate = normal(rng, size_t(rows * HD), 2.0f), beta = normal(rng, size_t(rows * H), 2.0f);
  const Vec A_log = normal(rng, size_t(H), 0.5f), dt_bias = normal(rng, size_t(HD), 0.5f);
  const Vec o_norm = normal(rng, size_t(D), 0.3f), state0 = normal(rng, size_t(places * H * D * D), 0.1f);
  auto dq = act(q), dk = act(k), dv = act(v), dgate = act(gate);
  DeviceBuffer<float> dz(z.data(), z.size()), dA(A_log.data(), A_log.size()), ddt(dt_bias.data(), dt_bias.size());
  DeviceBuffer<float> dw(o_norm.data(), o_norm.size());
  DeviceBuffer<int32_t> dslot(slot.data(), slot.size());
  auto params = [&](DeviceBuffer<float>& state, DeviceBuffer<float>& b, DeviceBuffer<T>& o) {
    kc::KdaParams p;
    p.B = B, p.T = Tn, p.H = H, p.D = D, p.scale = 1.0f / std::sqrt(float(D)), p.in_dtype = p.out_dtype = dt;
    p.q = dq.data(), p.k = dk.data(), p.v = dv.data(), p.o = o.data(), p.beta = b.data();
    p.state_in = p.state_out = state.data(), p.state_slot = dslot.data();
    return p;
  };
  // Four launches.
  DeviceBuffer<float> s1(state0.data(), state0.size()), b1(beta.data(), beta.size()), g(static_cast<size_t>(rows * HD));
  DeviceBuffer<T> o1(static_cast<size_t>(rows * HD));
  kc::gate_forward(g.data(), dz.data(), dA.data(), ddt.data(), -5.0f, rows, H, D);
  k3::elementwise::cuda::sigmoid_inplace(b1.data(), rows * H);
  kc::KdaParams p1 = params(s1, b1, o1);
  p1.g = g.data();
  kc::kda_recurrent_forward(p1);
  kc::gated_rmsnorm(o1.data(), o1.data(), dgate.data(), dw.data(), 1e-5f, rows, H, D);
  // One.
  DeviceBuffer<float> s2(state0.data(), state0.size()), b2(beta.data(), beta.size());
  DeviceBuffer<T> o2(static_cast<size_t>(rows * HD));
  kc::KdaGateNorm f;
  f.z = dz.data(), f.A_log = dA.data(), f.dt_bias = ddt.data(), f.lower_bound = -5.0f, f.out_gate = dgate.data();
  f.o_norm = dw.data(), f.o_eps = 1e-5f;
  kc::kda_recurrent_forward(params(s2, b2, o2), f);
  EXPECT_EQ(download(o2, size_t(rows * HD)), download(o1, size_t(rows * HD))) << "D " << D << " T " << Tn;
  EXPECT_EQ(download(s2, state0.size()), download(s1, state0.size())) << "D " << D << " T " << Tn;
}

TEST(CudaKdaRecurrent, GateAndNormFusedEqualSeparateLaunches) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(16);
  for (int D : kHeadDims)
    for (int64_t Tn : {int64_t(1), int64_t(3)}) {
      gate_norm_fused_matches<float>(D, Tn, rng);
      gate_norm_fused_matches<uint16_t>(D, Tn, rng);
    }
}

// A chunked prefill of T1 tokens, then decode steps (recurrent, T = 1), equals one chunked prefill of all
// tokens; and two chunked calls (a boundary inside a chunk) equal one.
TEST(CudaKdaChunk, PrefillThenDecodeEqualsLongerPrefill) {
  K3_REQUIRE_GPU();
  for (int D : kHeadDims) {
    for (bool bf16 : {true, false}) {
      const DType dt = bf16 ? DType::BF16 : DType::F32;
      const double tol = bf16 ? kBf16Tol : kChunkF32Tol;
      const int64_t B = 2, H = 3, T1 = 37, steps = 5, T = T1 + steps;
      const Case whole = make_case(B, T, H, 77 + dseed(D), bf16, false, D);
      const Result ref = gpu_run(whole, true, dt, dt);
      {  // the longer prefill itself is the CPU twin's answer
        const Result cpu = cpu_ref(whole);
        EXPECT_LE(rel(ref.o, cpu.o), tol) << "D=" << D;
        EXPECT_LE(rel(ref.state, cpu.state), tol) << "D=" << D;
      }
      // Slice tokens [t0, t1) of every sequence.
      auto slice = [&](int64_t t0, int64_t t1, const Vec& st) {
        Case c{B, t1 - t0, H, {}, {}, {}, {}, {}, st};
        c.D = whole.D;
        c.scale = whole.scale;
        for (int64_t b = 0; b < B; ++b) {
          const size_t x0 = size_t((b * T + t0) * H * D), x1 = size_t((b * T + t1) * H * D);
          const std::pair<Vec*, const Vec*> parts[] = {{&c.q, &whole.q},
                                                       {&c.k, &whole.k},
                                                       {&c.v, &whole.v},
                                                       {&c.g, &whole.g}};
          for (const auto& [dst, src] : parts) dst->insert(dst->end(), src->begin() + x0, src->begin() + x1);
          c.beta.insert(c.beta.end(), whole.beta.begin() + (b * T + t0) * H, whole.beta.begin() + (b * T + t1) * H);
        }
        return c;
      };
      // Prefill + decode.
      Result r = gpu_run(slice(0, T1, whole.state0), true, dt, dt);
      Vec last_o, ref_o;
      for (int64_t t = T1; t < T; ++t) {
        const Result step = gpu_run(slice(t, t + 1, r.state), false, dt, dt);
        r.state = step.state;
        last_o.insert(last_o.end(), step.o.begin(), step.o.end());
        for (int64_t b = 0; b < B; ++b) {
          const size_t x0 = size_t((b * T + t) * H * D);
          ref_o.insert(ref_o.end(), ref.o.begin() + x0, ref.o.begin() + x0 + H * D);
        }
      }
      // last_o is [step][b][h][d]; ref_o was gathered in the same order.
      const double eo = rel(last_o, ref_o), es = rel(r.state, ref.state);
      std::printf("[%s D=%d prefill %lld + %lld decode steps vs prefill %lld] rel L2: o %.3g, state %.3g\n",
                  k3::dtype_name(dt), D, (long long)T1, (long long)steps, (long long)T, eo, es);
      EXPECT_LE(eo, tol) << "D=" << D;
      EXPECT_LE(es, tol) << "D=" << D;
      // Two chunked calls, split at 21 (inside the second chunk).
      const Result a = gpu_run(slice(0, 21, whole.state0), true, dt, dt);
      const Result b2 = gpu_run(slice(21, T, a.state), true, dt, dt);
      EXPECT_LE(rel(b2.state, ref.state), tol) << "D=" << D;
    }
  }
}

// g = -5 on every token and channel: Gamma reaches -80 in every chunk, e^-Gamma = e^80. No NaN/Inf, and
// still the CPU's answer.
TEST(CudaKdaChunk, GatesAtTheBoundStayFinite) {
  K3_REQUIRE_GPU();
  for (int D : kHeadDims) {
    const Case c = make_case(2, 100, 2, 5 + dseed(D), true, /*all_at_bound=*/true, D);
    const Result ref = cpu_ref(c);
    const Result got = gpu_run(c, true, DType::BF16, DType::BF16);
    EXPECT_TRUE(all_finite(got.o)) << "D=" << D;
    EXPECT_TRUE(all_finite(got.state)) << "D=" << D;
    EXPECT_LE(rel(got.o, ref.o), kBf16Tol) << "D=" << D;
    EXPECT_LE(rel(got.state, ref.state), kBf16Tol) << "D=" << D;
    const Case c32 = make_case(1, 50, 2, 6 + dseed(D), false, true, D);
    const Result got32 = gpu_run(c32, true, DType::F32, DType::F32);
    EXPECT_LE(rel(got32.o, cpu_ref(c32).o), kChunkF32Tol) << "D=" << D;
  }
}

// The recurrence kernel of kda_chunk_forward picks its CTA shape (NW value groups of 16 columns, D / (16 NW)
// slices per head, each group split over KW key warps) from B * H and the SM count (kda_chunk_value_slices,
// kda_chunk_key_warps). Here, per head dim, one head count for every (slices, key warps) pair the kernel can
// choose on this GPU, at a full + partial chunk (T = 21) and at T = 50 (a partial fourth chunk).
TEST(CudaKdaChunk, EverySliceWidthMatchesCpu) {
  K3_REQUIRE_GPU();
  for (int D : kHeadDims) {
    std::vector<std::pair<int, int>> seen;
    for (int64_t H = 1; H <= 600; ++H) {
      const int slices = kc::kda_chunk_value_slices(1, H, DType::BF16, D);
      const int kw = kc::kda_chunk_key_warps(1, H, DType::BF16, D);
      ASSERT_TRUE(slices >= 1 && slices <= D / 16 && (D / 16) % slices == 0) << slices;
      ASSERT_TRUE((kw == 1 || kw == 2 || kw == 4) && 16 * kw <= D) << kw;
      if (std::find(seen.begin(), seen.end(), std::make_pair(slices, kw)) != seen.end()) continue;
      seen.emplace_back(slices, kw);
      for (int64_t T : {21, 50, 150}) {
        const Case c = make_case(1, T, H, 400 + uint32_t(H) + uint32_t(T) + dseed(D), true, false, D);
        expect_close(gpu_run(c, true, DType::BF16, DType::BF16), cpu_ref(c), kBf16Tol,
                     "chunk bf16, " + name(c) + ", " + std::to_string(slices) + " slices of " +
                         std::to_string(D / slices) + " columns, " + std::to_string(kw) + " key warps");
      }
    }
    std::printf("[D=%d] %zu (slices, key warps) pairs exercised\n", D, seen.size());
  }
  // The parity path uses one CTA width per D.
  EXPECT_EQ(kc::kda_chunk_value_slices(1, 1, DType::F32, 128), 2);
  EXPECT_EQ(kc::kda_chunk_value_slices(1, 1, DType::F32, 64), 1);
  EXPECT_EQ(kc::kda_chunk_value_slices(1, 1, DType::F32, 32), 1);
  for (int D : kHeadDims) EXPECT_EQ(kc::kda_chunk_key_warps(1, 1, DType::F32, D), 1);
}

// 65536 tokens (4096 chunks), two heads: finite, and the CPU's answer (its chunked form, for time).
TEST(CudaKdaChunk, LongSequenceFiniteAndCorrect) {
  K3_REQUIRE_GPU();
  for (int D : kHeadDims) {
    const Case c = make_case(1, 65536, 2, 9 + dseed(D), true, false, D);
    const Result got = gpu_run(c, true, DType::BF16, DType::BF16);
    EXPECT_TRUE(all_finite(got.o)) << "D=" << D;
    EXPECT_TRUE(all_finite(got.state)) << "D=" << D;
    expect_close(got, cpu_ref(c, /*chunked=*/true), kBf16Tol, "chunk bf16, T=65536 H=2 D=" + std::to_string(D));
  }
}

// The prepare kernel's workspace (layout in kda_cuda.h) against the same algebra in fp64 on the CPU: this
// localises a failure of the chunked form to one of its two kernels. One sequence of 21 tokens (a full and a
// partial chunk), two heads, at every head dim. Item layout (bf16 inputs, kda_cuda.h): Qw @0, Kw @32D,
// -Kr @64D, -Aw @96D, Mw @96D+512, gamma @96D+1024, 100D+1024 bytes; the tiles swizzled by kda_ws_tile_index.
TEST(CudaKdaChunk, PrepareWorkspaceMatchesAlgebra) {
  K3_REQUIRE_GPU();
  constexpr int C = 16;
  for (const int D : kHeadDims) {
    const size_t kItem = size_t(100 * D + 1024);
    const Case c = make_case(1, 21, 2, 31 + dseed(D), true, false, D);
    DeviceBuffer<float> g(c.g.data(), c.g.size()), beta(c.beta.data(), c.beta.size());
    DeviceBuffer<uint16_t> q(to_bf16(c.q).data(), c.q.size()), k(to_bf16(c.k).data(), c.k.size()),
        v(to_bf16(c.v).data(), c.v.size()), o(c.q.size());
    const size_t bytes = kc::kda_chunk_workspace_bytes(1, c.T, c.H, DType::BF16, D);
    ASSERT_EQ(bytes, size_t(2 * 2) * kItem) << "D=" << D;
    if (D == 128) {
      ASSERT_EQ(kItem, size_t(13824));
    }
    DeviceBuffer<unsigned char> ws(bytes);
    kc::KdaParams p;
    p.B = 1;
    p.T = c.T;
    p.H = c.H;
    p.D = D;
    p.scale = c.scale;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.g = g.data();
    p.beta = beta.data();
    p.o = o.data();
    p.workspace = ws.data();
    p.workspace_bytes = bytes;
    p.stage = kc::KdaParams::Stage::kPrepareOnly;
    kc::kda_chunk_forward(p);
    std::vector<unsigned char> w(bytes);
    ws.download(w.data(), bytes);
    auto bf = [&](size_t item, size_t byte_off, size_t i) {
      uint16_t u;
      std::memcpy(&u, &w[item * kItem + byte_off + 2 * i], 2);
      return k3::bf16_to_f32(u);
    };
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t h = 0; h < c.H; ++h) {
        const size_t item = size_t(n * c.H + h);
        const int64_t t0 = n * C, nv = std::min<int64_t>(C, c.T - t0);
        // fp64 algebra (kda_cuda.h): Qd, Kd, Ki, Kr, gamma; L, M; Aw; Mw, Kw, Qw.
        std::vector<double> Qd(C * D), Kd(C * D), Ki(C * D), Kr(C * D), gam(D), L(C * C), M(C * C), Aw(C * C),
            Mw(C * C), Kw(C * D), Qw(C * D), bt(C);
        for (int d = 0; d < D; ++d) {
          double G = 0, Gi[C];
          for (int i = 0; i < C; ++i) {
            G += i < nv ? c.g[((t0 + i) * c.H + h) * D + d] : 0.0;
            Gi[i] = G;
          }
          for (int i = 0; i < C; ++i) {
            const double qv = i < nv ? c.q[((t0 + i) * c.H + h) * D + d] : 0.0;
            const double kv = i < nv ? c.k[((t0 + i) * c.H + h) * D + d] : 0.0;
            Qd[i * D + d] = c.scale * qv * std::exp(Gi[i]);
            Kd[i * D + d] = kv * std::exp(Gi[i]);
            Ki[i * D + d] = kv * std::exp(-Gi[i]);
            Kr[i * D + d] = kv * std::exp(G - Gi[i]);
          }
          gam[d] = std::exp(G);
        }
        for (int i = 0; i < C; ++i) bt[i] = i < nv ? c.beta[(t0 + i) * c.H + h] : 0.0;
        for (int i = 0; i < C; ++i)
          for (int j = 0; j < C; ++j) {
            double a = 0, m = 0;
            for (int d = 0; d < D; ++d) {
              a += Kd[i * D + d] * Ki[j * D + d];
              m += Qd[i * D + d] * Ki[j * D + d];
            }
            L[i * C + j] = i > j ? bt[i] * a : 0.0;
            M[i * C + j] = i >= j ? m : 0.0;
          }
        for (int col = 0; col < C; ++col)
          for (int i = 0; i < C; ++i) {
            double s = i == col ? bt[i] : 0.0;
            for (int j = 0; j < i; ++j) s -= L[i * C + j] * Aw[j * C + col];
            Aw[i * C + col] = s;
          }
        for (int i = 0; i < C; ++i)
          for (int j = 0; j < C; ++j) {
            double s = 0;
            for (int l = 0; l < C; ++l) s += M[i * C + l] * Aw[l * C + j];
            Mw[i * C + j] = s;
          }
        for (int i = 0; i < C; ++i)
          for (int d = 0; d < D; ++d) {
            double kw = 0, mk = 0;
            for (int j = 0; j < C; ++j) {
              kw += Aw[i * C + j] * Kd[j * D + d];
              mk += Mw[i * C + j] * Kd[j * D + d];
            }
            Kw[i * D + d] = kw;
            Qw[i * D + d] = Qd[i * D + d] - mk;
          }
        // Tiles of `width` columns, read back through the swizzle (kda_ws_tile_index).
        auto cmp = [&](const char* what, size_t off, const std::vector<double>& ref, double sign) {
          const int width = int(ref.size() / C);
          Vec got(ref.size()), r(ref.size());
          for (size_t i = 0; i < ref.size(); ++i) {
            got[i] = bf(item, off, size_t(kc::kda_ws_tile_index(int(i) / width, int(i) % width, width)));
            r[i] = float(sign * ref[i]);
          }
          const double e = rel(got, r);
          EXPECT_LE(e, kBf16Tol) << what << " chunk " << n << " head " << h << " D=" << D;
          return e;
        };
        const size_t ud = size_t(D);
        const double e1 = cmp("Qw", 0, Qw, 1), e2 = cmp("Kw", 32 * ud, Kw, 1), e3 = cmp("-Kr", 64 * ud, Kr, -1),
                     e4 = cmp("-Aw", 96 * ud, Aw, -1), e5 = cmp("Mw", 96 * ud + 512, Mw, 1);
        Vec gg(D), gr(D);
        std::memcpy(gg.data(), &w[item * kItem + 96 * ud + 1024], ud * 4);
        for (int d = 0; d < D; ++d) gr[d] = float(gam[d]);
        const double e6 = rel(gg, gr);
        // gamma = e^G with G summed in fp32: |G| <= 80, 16 additions of <= 2^-24 * 80 each -> <= 7.6e-5 in G.
        EXPECT_LE(e6, 1e-4) << "gamma chunk " << n << " head " << h << " D=" << D;
        std::printf(
            "[workspace D=%d chunk %lld head %lld] rel L2: Qw %.2g Kw %.2g Kr %.2g Aw %.2g Mw %.2g "
            "gamma %.2g\n",
            D, (long long)n, (long long)h, e1, e2, e3, e4, e5, e6);
      }
  }
}

// Every tail length class of the 16-token chunks (1..15 past a multiple, exact multiples, one past, and
// lengths past a 64-token boundary), two sequences with their own initial states, at every head dim: the
// chunked bf16 path against the CPU recurrence.
TEST(CudaKdaChunk, Bf16EveryTailLength) {
  K3_REQUIRE_GPU();
  const int64_t lengths[] = {2, 7, 31, 33, 48, 63, 64, 65, 80, 127, 128, 129, 191, 192, 250};
  for (int D : kHeadDims) {
    for (const int64_t T : lengths) {
      const Case c = make_case(2, T, 2, 500 + uint32_t(T) + dseed(D), true, false, D);
      expect_close(gpu_run(c, true, DType::BF16, DType::BF16), cpu_ref(c), kBf16Tol, "chunk bf16 tails, " + name(c));
    }
  }
}

TEST(CudaKdaChunk, CanRunNamesTheProblem) {
  K3_REQUIRE_GPU();
  kc::KdaParams p;
  p.B = 1;
  p.T = 16;
  p.H = 1;
  EXPECT_NE(kc::kda_chunk_can_run(p).find("required"), std::string::npos) << kc::kda_chunk_can_run(p);
  EXPECT_THROW(kc::kda_chunk_forward(p), k3::Error);
  DeviceBuffer<float> dummy(16 * kK3HeadDim * 2);
  p.q = p.k = p.v = p.o = dummy.data();
  p.g = p.beta = dummy.data();
  p.workspace = dummy.data();
  p.workspace_bytes = 100;
  EXPECT_NE(kc::kda_chunk_can_run(p).find("needs 13824"), std::string::npos) << kc::kda_chunk_can_run(p);
  EXPECT_NE(kc::kda_recurrent_can_run(p).find("state_in and state_out"), std::string::npos);
  p.D = 64;
  EXPECT_NE(kc::kda_chunk_can_run(p).find("needs 7424"), std::string::npos) << kc::kda_chunk_can_run(p);
  p.D = 32;
  EXPECT_NE(kc::kda_chunk_can_run(p).find("needs 4224"), std::string::npos) << kc::kda_chunk_can_run(p);
  // A head dim the kernels do not take: both can_run name it, both forwards throw, the sizes throw.
  for (int bad : {48, 96, 256, 0}) {
    p.D = bad;
    const std::string want = "got D = " + std::to_string(bad);
    EXPECT_NE(kc::kda_chunk_can_run(p).find(want), std::string::npos) << kc::kda_chunk_can_run(p);
    EXPECT_THROW(kc::kda_chunk_forward(p), k3::Error);
    p.state_in = p.state_out = dummy.data();
    EXPECT_NE(kc::kda_recurrent_can_run(p).find(want), std::string::npos) << kc::kda_recurrent_can_run(p);
    EXPECT_THROW(kc::kda_recurrent_forward(p), k3::Error);
    p.state_in = nullptr;
    p.state_out = nullptr;
    EXPECT_THROW(kc::kda_chunk_workspace_bytes(1, 16, 1, DType::BF16, bad), k3::Error);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Short conv + SiLU: B sequences with tails, against the CPU twin per sequence; then a prefill split into
// a shorter prefill and single decode steps gives bit-identical outputs and tails (same code, same order).
TEST(CudaKdaConv, MatchesCpuAndDecodeStepsEqualPrefill) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(11);
  const int64_t B = 2, C = 200;
  const int K = 4, P = K - 1;
  const Vec w = normal(rng, size_t(C * K), 0.5f);
  DeviceBuffer<float> dw(w.data(), w.size());
  for (int64_t T : {1, 2, 37}) {
    for (bool bf16 : {false, true}) {
      Vec x = normal(rng, size_t(B * T * C));
      if (bf16) x = round_bf16(x);
      const Vec tail0 = round_bf16(normal(rng, size_t(B * P * C)));
      // CPU
      Vec ref(x.size()), ref_tail = tail0;
      for (int64_t b = 0; b < B; ++b)
        k3::kda::short_conv_silu_forward(ref.data() + b * T * C, x.data() + b * T * C, T, C, w.data(), K,
                                         ref_tail.data() + b * P * C);
      // GPU
      DeviceBuffer<float> dtail(tail0.data(), tail0.size());
      Vec got;
      if (bf16) {
        DeviceBuffer<uint16_t> dx(to_bf16(x).data(), x.size()), dout(x.size());
        kc::short_conv_silu(dout.data(), dx.data(), B, T, C, dw.data(), K, dtail.data());
        got = from_bf16(download(dout, x.size()));
      } else {
        DeviceBuffer<float> dx(x.data(), x.size()), dout(x.size());
        kc::short_conv_silu(dout.data(), dx.data(), B, T, C, dw.data(), K, dtail.data());
        got = download(dout, x.size());
      }
      EXPECT_LE(rel(got, ref), bf16 ? kBf16Tol : kF32Tol) << "T=" << T << " bf16=" << bf16;
      EXPECT_EQ(download(dtail, tail0.size()), ref_tail) << "T=" << T;
    }
  }
  // Prefill 37 == prefill 30 + 7 decode steps (fp32, bit for bit).
  const int64_t T = 37, T1 = 30;
  const Vec x = normal(rng, size_t(B * T * C));
  DeviceBuffer<float> dx(x.data(), x.size()), dout(x.size()), dtail(size_t(B * P * C));
  kc::short_conv_silu(dout.data(), dx.data(), B, T, C, dw.data(), K, dtail.data());
  const Vec whole = download(dout, x.size());
  const Vec whole_tail = download(dtail, size_t(B * P * C));
  DeviceBuffer<float> tail2(size_t(B * P * C));
  auto rows = [&](int64_t t0, int64_t t1) {
    Vec r;
    for (int64_t b = 0; b < B; ++b) r.insert(r.end(), x.begin() + (b * T + t0) * C, x.begin() + (b * T + t1) * C);
    return r;
  };
  auto out_rows = [&](int64_t t0, int64_t t1) {
    Vec r;
    for (int64_t b = 0; b < B; ++b)
      r.insert(r.end(), whole.begin() + (b * T + t0) * C, whole.begin() + (b * T + t1) * C);
    return r;
  };
  {
    const Vec xp = rows(0, T1);
    DeviceBuffer<float> dxp(xp.data(), xp.size()), dop(xp.size());
    kc::short_conv_silu(dop.data(), dxp.data(), B, T1, C, dw.data(), K, tail2.data());
    EXPECT_EQ(download(dop, xp.size()), out_rows(0, T1));
  }
  for (int64_t t = T1; t < T; ++t) {
    const Vec xs = rows(t, t + 1);
    DeviceBuffer<float> dxs(xs.data(), xs.size()), dos(xs.size());
    kc::short_conv_silu(dos.data(), dxs.data(), B, 1, C, dw.data(), K, tail2.data());
    EXPECT_EQ(download(dos, xs.size()), out_rows(t, t + 1)) << "t=" << t;
  }
  EXPECT_EQ(download(tail2, size_t(B * P * C)), whole_tail);
}

// One decode step of q, k, v through conv_qkv_decode (one launch, the q and k norms fused) against
// short_conv_silu on each and l2norm_heads on q and k, bit for bit: outputs and tails, sequences in a pool of
// more places in a scrambled order, fp32 and bf16, every head dim it takes.
template <class T>
void conv_qkv_matches_separate_launches(int64_t D, std::mt19937& rng) {
  const int64_t B = 3, H = 5, C = H * D, places = 6;
  const int K = 4, P = K - 1;
  const std::vector<int32_t> slot = {4, 0, 2};
  DeviceBuffer<int32_t> dslot(slot.data(), slot.size());
  std::vector<DeviceBuffer<float>> w, tail_a, tail_b;
  std::vector<Vec> x(3);
  for (int i = 0; i < 3; ++i) {
    const Vec wi = normal(rng, size_t(C * K), 0.5f), ti = round_bf16(normal(rng, size_t(places * P * C)));
    x[size_t(i)] = round_bf16(normal(rng, size_t(B * C)));
    w.emplace_back(wi.data(), wi.size());
    tail_a.emplace_back(ti.data(), ti.size());
    tail_b.emplace_back(ti.data(), ti.size());
  }
  auto upload = [&](const Vec& v) {
    if constexpr (std::is_same_v<T, float>) return DeviceBuffer<float>(v.data(), v.size());
    else return DeviceBuffer<uint16_t>(to_bf16(v).data(), v.size());
  };
  std::vector<DeviceBuffer<T>> in, out_a, out_b;
  for (int i = 0; i < 3; ++i)
    in.push_back(upload(x[size_t(i)])), out_a.emplace_back(size_t(B * C)), out_b.emplace_back(size_t(B * C));
  for (int i = 0; i < 3; ++i)
    kc::short_conv_silu(out_a[size_t(i)].data(), in[size_t(i)].data(), B, 1, C, w[size_t(i)].data(), K,
                        tail_a[size_t(i)].data(), dslot.data());
  kc::l2norm_heads(out_a[0].data(), B, H, D, 1e-6f);
  kc::l2norm_heads(out_a[1].data(), B, H, D, 1e-6f);
  kc::conv_qkv_decode({out_b[0].data(), out_b[1].data(), out_b[2].data()}, {in[0].data(), in[1].data(), in[2].data()},
                      {w[0].data(), w[1].data(), w[2].data()}, K,
                      {tail_b[0].data(), tail_b[1].data(), tail_b[2].data()}, dslot.data(), B, H, D, 1e-6f);
  for (int i = 0; i < 3; ++i) {
    std::vector<T> a(size_t(B * C)), b(size_t(B * C));
    k3::cuda::copy_to_host(a.data(), out_a[size_t(i)].data(), a.size() * sizeof(T));
    k3::cuda::copy_to_host(b.data(), out_b[size_t(i)].data(), b.size() * sizeof(T));
    EXPECT_EQ(a, b) << "tensor " << i << " D " << D;
    EXPECT_EQ(download(tail_a[size_t(i)], size_t(places * P * C)), download(tail_b[size_t(i)], size_t(places * P * C)))
        << "tail " << i << " D " << D;
  }
}

TEST(CudaKdaConv, FusedDecodeStepEqualsSeparateLaunches) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(15);
  for (int64_t D : {32, 64, 96, 128}) {
    conv_qkv_matches_separate_launches<float>(D, rng);
    conv_qkv_matches_separate_launches<uint16_t>(D, rng);
  }
  DeviceBuffer<float> f(size_t(64));
  DeviceBuffer<int32_t> slot(size_t(1));
  EXPECT_THROW(kc::conv_qkv_decode({f.data(), f.data(), f.data()}, {f.data(), f.data(), f.data()},
                                   {f.data(), f.data(), f.data()}, 4, {f.data(), f.data(), f.data()}, slot.data(), 1, 1,
                                   48, 1e-6f),
               k3::Error);
}

TEST(CudaKdaL2Norm, MatchesCpu) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(12);
  for (int64_t Dh : {128, 100, 64, 32}) {
    const int64_t rows = 37, H = 3;
    const Vec x = round_bf16(normal(rng, size_t(rows * H * Dh), 2.0f));
    Vec ref = x;
    k3::kda::l2norm_heads(ref.data(), rows, H, Dh, 1e-6f);
    DeviceBuffer<float> d(x.data(), x.size());
    kc::l2norm_heads(d.data(), rows, H, Dh, 1e-6f);
    EXPECT_LE(rel(download(d, x.size()), ref), kF32Tol) << "D=" << Dh;
    DeviceBuffer<uint16_t> db(to_bf16(x).data(), x.size());
    kc::l2norm_heads(db.data(), rows, H, Dh, 1e-6f);
    EXPECT_LE(rel(from_bf16(download(db, x.size())), ref), kBf16Tol) << "D=" << Dh;
  }
}

TEST(CudaKdaGate, MatchesCpuAndRespectsTheBound) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(13);
  const int64_t rows = 37, H = 3;
  constexpr int64_t D = kK3HeadDim;
  Vec z = round_bf16(normal(rng, size_t(rows * H * D), 3.0f));
  for (size_t i = 0; i < z.size(); i += 97) z[i] = 1e4f;  // saturates: g = -5 exactly
  const Vec A_log = normal(rng, size_t(H), 0.5f), dt = normal(rng, size_t(H * D), 0.5f);
  Vec ref(z.size());
  k3::kda::gate_forward(ref.data(), z.data(), A_log.data(), dt.data(), -5.0f, rows, H, D);
  DeviceBuffer<float> dz(z.data(), z.size()), dA(A_log.data(), A_log.size()), ddt(dt.data(), dt.size()), dg(z.size());
  kc::gate_forward(dg.data(), dz.data(), dA.data(), ddt.data(), -5.0f, rows, H, D);
  const Vec got = download(dg, z.size());
  EXPECT_LE(rel(got, ref), kF32Tol);
  for (float v : got) ASSERT_TRUE(v >= -5.0f && v <= 0.0f) << v;
  EXPECT_EQ(got[0], -5.0f);
  DeviceBuffer<uint16_t> dzb(to_bf16(z).data(), z.size());
  kc::gate_forward(dg.data(), dzb.data(), dA.data(), ddt.data(), -5.0f, rows, H, D);
  EXPECT_LE(rel(download(dg, z.size()), ref), kF32Tol);  // z is exactly bf16, g is fp32 either way

  // beta: made sigmoid(beta) in place by the same launch, the bits of elementwise::cuda::sigmoid_inplace.
  const Vec beta = normal(rng, size_t(rows * H), 4.0f);
  DeviceBuffer<float> db1(beta.data(), beta.size()), db2(beta.data(), beta.size()), dg2(z.size());
  kc::gate_forward(dg2.data(), dzb.data(), dA.data(), ddt.data(), -5.0f, rows, H, D, db1.data());
  k3::elementwise::cuda::sigmoid_inplace(db2.data(), rows * H);
  EXPECT_EQ(download(db1, beta.size()), download(db2, beta.size()));
  EXPECT_EQ(download(dg2, z.size()), download(dg, z.size()));
}

TEST(CudaKdaGatedRmsNorm, MatchesCpuInPlace) {
  K3_REQUIRE_GPU();
  std::mt19937 rng(14);
  for (int64_t Dv : {128, 72, 64, 32}) {
    const int64_t rows = 37, H = 3;
    const Vec o = round_bf16(normal(rng, size_t(rows * H * Dv), 3.0f));
    const Vec gate = round_bf16(normal(rng, o.size(), 2.0f));
    const Vec w = normal(rng, size_t(Dv));
    Vec ref(o.size());
    k3::kda::gated_rmsnorm_forward(ref.data(), o.data(), gate.data(), w.data(), 1e-5f, rows, H, Dv);
    DeviceBuffer<float> d(o.data(), o.size()), dg(gate.data(), gate.size()), dw(w.data(), w.size());
    kc::gated_rmsnorm(d.data(), d.data(), dg.data(), dw.data(), 1e-5f, rows, H, Dv);  // y aliases o
    EXPECT_LE(rel(download(d, o.size()), ref), kF32Tol) << "Dv=" << Dv;
    DeviceBuffer<uint16_t> db(to_bf16(o).data(), o.size()), dgb(to_bf16(gate).data(), o.size()), yb(o.size());
    kc::gated_rmsnorm(yb.data(), db.data(), dgb.data(), dw.data(), 1e-5f, rows, H, Dv);
    EXPECT_LE(rel(from_bf16(download(yb, o.size())), ref), kBf16Tol) << "Dv=" << Dv;
  }
}

}  // namespace
