// The dense CUDA kernels against their CPU twins on random inputs of awkward sizes: the cuBLAS(Lt)
// GEMM (kernels/gemm/linear_cuda.h), f32<->bf16 conversion and the embedding gather
// (convert_cuda.h), RMSNorm (norm_cuda.h), SiTU-GLU (glu_cuda.h) and the fused Block AttnRes
// (+ RMSNorm) (attnres_cuda.h). Every test skips without a Hopper GPU (K3_REQUIRE_GPU).
//
// Tolerances (relative L2, util/compare.h, which fails on any non-finite value first):
//   - bf16 outputs: 1e-2 (one bf16 rounding is <= 2^-8 relative per element).
//   - fp32 outputs of fp32 math (norm, GLU, AttnRes, bf16 inputs widened exactly): 1e-5.
//   - BF16 GEMM with fp32 output: 1e-3. Products of bf16 values are exact in fp32; only the fp32
//     accumulation differs from the fp64 CPU twin, <= ~6e-4 even if every tensor-core add truncated
//     (K = 7168), ~1e-6 with round-to-nearest.
//   - F32 GEMM (TF32 off): 1e-6 on random data with K <= 1000 (fp32 sequential accumulation is
//     ~5e-7 there; TF32 would be ~1e-3), and EXACT equality at K = 7168 on integer data whose every
//     partial sum is exact in fp32 (random data at K = 7168 sits at ~1.5e-6 from fp32 rounding
//     alone, so 1e-6 is not a meaningful bound there).
//   - Conversions and the embedding gather: bit-exact against core/dtype.h.
// Outputs are written into buffers with 256 guard bytes on each side (and padding columns for
// strided cases) filled with 0xFF, checked unchanged afterwards; 0xFF..FF is NaN in fp32 and bf16,
// so an element a kernel forgets to write fails the finite check.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/attnres/attnres.h"
#include "kernels/attnres/attnres_cuda.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/ffn/glu.h"
#include "kernels/ffn/glu_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/gemm/linear.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/gemm/linear_rows_cuda.h"
#include "kernels/norm/norm.h"
#include "kernels/norm/norm_cuda.h"
#include "util/compare.h"
#include "util/random.h"

namespace {

using k3::DType;
namespace kc = k3::cuda;

// The CPU reference linears accumulate in fp64 while this lives; the process-wide choice before it is
// restored on every exit (a failed ASSERT returns early, an error throws).
struct F64LinearsScope {
  k3::GemmPrecision saved = k3::gemm_precision();
  F64LinearsScope() { k3::set_gemm_precision(k3::GemmPrecision::F64Accumulate); }
  ~F64LinearsScope() { k3::set_gemm_precision(saved); }
  F64LinearsScope(const F64LinearsScope&) = delete;
  F64LinearsScope& operator=(const F64LinearsScope&) = delete;
};

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;
constexpr double kTolGemmBf16F32 = 1e-3;
constexpr double kTolGemmF32 = 1e-6;

std::vector<float> randf(int64_t n, uint64_t seed, double scale = 1.0) {
  const auto d = k3test::randn(n, seed);
  std::vector<float> v(d.size());
  for (size_t i = 0; i < d.size(); ++i) v[i] = float(d[i] * scale);
  return v;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = k3::f32_to_bf16(v[i]);
  return o;
}
std::vector<float> widen(const std::vector<uint16_t>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = k3::bf16_to_f32(v[i]);
  return o;
}
// Values rounded to bf16 (what a bf16 operand holds), kept as float.
std::vector<float> bf16_round(const std::vector<float>& v) { return widen(to_bf16(v)); }

const char* tname(DType t) { return k3::dtype_name(t); }
double tol_for(DType out) { return out == DType::BF16 ? kTolBf16 : kTolF32; }

// A device input of dtype t holding `v` (rounded to bf16 when t is BF16).
struct DevIn {
  kc::DeviceBuffer<uint8_t> buf;
  DevIn(const std::vector<float>& v, DType t) : buf(v.size() * k3::dtype_size(t) + 16) {
    if (t == DType::BF16) {
      const auto b = to_bf16(v);
      kc::copy_to_device(buf.data(), b.data(), b.size() * 2);
    } else {
      kc::copy_to_device(buf.data(), v.data(), v.size() * 4);
    }
  }
  void* data() { return buf.data(); }
};

// A device output of `n` elements of dtype t with 256 guard bytes of 0xFF on each side.
struct GuardedOut {
  static constexpr size_t kGuard = 256;
  DType t;
  size_t n, bytes;
  kc::DeviceBuffer<uint8_t> buf;
  GuardedOut(size_t n_, DType t_) : t(t_), n(n_), bytes(n_ * k3::dtype_size(t_)), buf(bytes + 2 * kGuard) {
    std::vector<uint8_t> ff(bytes + 2 * kGuard, 0xFF);
    buf.upload(ff.data(), ff.size());
  }
  void* data() { return buf.data() + kGuard; }
  std::vector<uint8_t> raw() const {
    std::vector<uint8_t> h(bytes + 2 * kGuard);
    buf.download(h.data(), h.size());
    return h;
  }
  // Element i as float.
  static float at(const std::vector<uint8_t>& raw, DType t, size_t i) {
    const uint8_t* p = raw.data() + kGuard + i * k3::dtype_size(t);
    if (t == DType::BF16) {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return k3::bf16_to_f32(h);
    }
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  static bool untouched(const std::vector<uint8_t>& raw, DType t, size_t i) {
    const uint8_t* p = raw.data() + kGuard + i * k3::dtype_size(t);
    for (size_t b = 0; b < k3::dtype_size(t); ++b)
      if (p[b] != 0xFF) return false;
    return true;
  }
  // Rows [rows, cols] of stride ld as floats; checks the guards and the padding columns.
  std::vector<float> rows(int64_t nrows, int64_t cols, int64_t ld, std::string* bad) const {
    const auto r = raw();
    for (size_t i = 0; i < kGuard; ++i)
      if (r[i] != 0xFF || r[kGuard + bytes + i] != 0xFF) {
        *bad = "guard byte overwritten";
        break;
      }
    std::vector<float> v(size_t(nrows * cols));
    for (int64_t i = 0; i < nrows; ++i) {
      for (int64_t j = 0; j < cols; ++j) v[size_t(i * cols + j)] = at(r, t, size_t(i * ld + j));
      for (int64_t j = cols; j < ld && size_t(i * ld + j) < n; ++j)
        if (!untouched(r, t, size_t(i * ld + j))) *bad = "padding column overwritten at row " + std::to_string(i);
    }
    return v;
  }
  std::vector<float> values(std::string* bad) const { return rows(1, int64_t(n), int64_t(n), bad); }
};

// ---------------------------------------------------------------------------------------------
// Conversions and the embedding gather: bit-exact.

TEST(CudaDense, ConvertF32ToBf16BitExact) {
  K3_REQUIRE_GPU();
  // Random values over many binades, plus the special cases of the rounding rule.
  const int64_t n = 1000003;  // odd: a scalar tail after the 8-wide packs
  auto v = randf(n, 11);
  for (int64_t i = 0; i < n; i += 7) v[size_t(i)] = std::ldexp(v[size_t(i)], int(i % 200) - 100);
  const uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffa12345u,
                               0x80000000u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u,
                               0x3f80ffffu, 0x7f7fffffu, 0x7f7f8000u, 0x00008000u};
  for (size_t i = 0; i < sizeof(specials) / 4; ++i) std::memcpy(&v[i * 13], &specials[i], 4);
  kc::DeviceBuffer<float> src(v.data(), v.size());
  for (int off : {0, 1}) {  // off = 1: pointers not 16-byte aligned, the scalar path
    GuardedOut out(size_t(n - off), DType::BF16);
    k3::gemm::cuda::convert_f32_to_bf16(static_cast<uint16_t*>(out.data()), src.data() + off, n - off);
    kc::synchronize();
    const auto r = out.raw();
    for (size_t i = 0; i < GuardedOut::kGuard; ++i)
      ASSERT_TRUE(r[i] == 0xFF && r[GuardedOut::kGuard + out.bytes + i] == 0xFF) << "guard overwritten, off " << off;
    for (int64_t i = 0; i < n - off; ++i) {
      uint16_t got;
      std::memcpy(&got, r.data() + GuardedOut::kGuard + size_t(i) * 2, 2);
      const uint16_t want = k3::f32_to_bf16(v[size_t(i + off)]);
      ASSERT_EQ(got, want) << "element " << i << " off " << off << " value " << v[size_t(i + off)];
    }
  }
}

TEST(CudaDense, ConvertBf16ToF32AllPatterns) {
  K3_REQUIRE_GPU();
  std::vector<uint16_t> all(65536 + 5);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i * 40503u);  // odd multiplier: every pattern
  kc::DeviceBuffer<uint16_t> src(all.data(), all.size());
  for (int off : {0, 3}) {
    const int64_t n = int64_t(all.size()) - off;
    GuardedOut out(size_t(n), DType::F32);
    k3::gemm::cuda::convert_bf16_to_f32(static_cast<float*>(out.data()), src.data() + off, n);
    kc::synchronize();
    const auto r = out.raw();
    for (size_t i = 0; i < GuardedOut::kGuard; ++i)
      ASSERT_TRUE(r[i] == 0xFF && r[GuardedOut::kGuard + out.bytes + i] == 0xFF) << "guard overwritten, off " << off;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t got, want;
      std::memcpy(&got, r.data() + GuardedOut::kGuard + size_t(i) * 4, 4);
      const float wf = k3::bf16_to_f32(all[size_t(i + off)]);
      std::memcpy(&want, &wf, 4);
      ASSERT_EQ(got, want) << "pattern 0x" << std::hex << all[size_t(i + off)];
    }
  }
}

TEST(CudaDense, EmbeddingGatherBitExact) {
  K3_REQUIRE_GPU();
  for (int64_t D : {int64_t(128), int64_t(7168), int64_t(130)}) {  // 130: not a multiple of 8, the scalar path
    const int64_t V = 1000, T = 37;
    const auto table = to_bf16(randf(V * D, 21 + uint64_t(D)));
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = int32_t((t * 7919 + 3) % V);
    ids[5] = ids[6] = 0;
    ids[7] = int32_t(V - 1);
    ids[8] = -1;          // out of range: NaN row
    ids[9] = int32_t(V);  // out of range: NaN row
    kc::DeviceBuffer<uint16_t> dt(table.data(), table.size());
    kc::DeviceBuffer<int32_t> di(ids.data(), ids.size());
    GuardedOut out(size_t(T * D), DType::F32);
    k3::gemm::cuda::embedding_gather(static_cast<float*>(out.data()), dt.data(), di.data(), T, V, D);
    kc::synchronize();
    std::string bad;
    const auto got = out.values(&bad);
    ASSERT_TRUE(bad.empty()) << bad << " (D " << D << ")";
    for (int64_t t = 0; t < T; ++t) {
      const int32_t id = ids[size_t(t)];
      for (int64_t d = 0; d < D; ++d) {
        const float g = got[size_t(t * D + d)];
        if (id < 0 || id >= V) {
          ASSERT_TRUE(std::isnan(g)) << "bad id " << id << " must give NaN, D " << D;
        } else {
          const float w = k3::bf16_to_f32(table[size_t(id * D + d)]);
          ASSERT_EQ(std::memcmp(&g, &w, 4), 0) << "token " << t << " id " << id << " d " << d << " D " << D;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

TEST(CudaDense, RmsNormMatchesCpu) {
  K3_REQUIRE_GPU();
  const DType types[] = {DType::F32, DType::BF16};
  for (int64_t N : {int64_t(1), int64_t(37)})
    for (int64_t D : {int64_t(128), int64_t(7168), int64_t(1000), int64_t(130)})
      for (DType tin : types)
        for (DType tout : types)
          for (bool with_w : {true, false}) {
            const std::string ctx = "N=" + std::to_string(N) + " D=" + std::to_string(D) + " " + tname(tin) + "->" +
                                    tname(tout) + (with_w ? " weight" : " no weight");
            auto x = randf(N * D, 100 + uint64_t(N * D), 3.0);
            if (tin == DType::BF16) x = bf16_round(x);
            auto w = randf(D, 200 + uint64_t(D), 0.5);
            for (auto& e : w) e += 1.0f;
            const float eps = 1e-5f;
            std::vector<float> ref(size_t(N * D));
            k3::rmsnorm_forward(ref.data(), x.data(), with_w ? w.data() : nullptr, eps, N, D);

            DevIn dx(x, tin);
            kc::DeviceBuffer<float> dw(w.data(), w.size());
            GuardedOut out(size_t(N * D), tout);
            k3::norm::cuda::RmsNormParams p;
            p.y = out.data(), p.y_type = tout, p.x = dx.data(), p.x_type = tin;
            p.weight = with_w ? dw.data() : nullptr, p.eps = eps, p.N = N, p.D = D;
            ASSERT_EQ(k3::norm::cuda::can_run(p), "") << ctx;
            k3::norm::cuda::rmsnorm_forward(p);
            kc::synchronize();
            std::string bad;
            const auto got = out.values(&bad);
            ASSERT_TRUE(bad.empty()) << bad << " " << ctx;
            const double e = k3test::rel_l2(got, ref);
            EXPECT_LE(e, tol_for(tout)) << ctx;
          }
}

TEST(CudaDense, RmsNormStridedAndInPlace) {
  K3_REQUIRE_GPU();
  const int64_t N = 19, D = 7168, ld = D + 64;
  auto x = randf(N * ld, 7, 2.0);
  auto w = randf(D, 8, 0.3);
  std::vector<float> xr(size_t(N * D)), ref(size_t(N * D));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t d = 0; d < D; ++d) xr[size_t(i * D + d)] = x[size_t(i * ld + d)];
  k3::rmsnorm_forward(ref.data(), xr.data(), w.data(), 1e-6f, N, D);
  // Strided fp32 in, strided bf16 out with padding columns that must stay untouched.
  {
    kc::DeviceBuffer<float> dx(x.data(), x.size());
    kc::DeviceBuffer<float> dw(w.data(), w.size());
    GuardedOut out(size_t(N * ld), DType::BF16);
    k3::norm::cuda::RmsNormParams p;
    p.y = out.data(), p.y_type = DType::BF16, p.ld_y = ld, p.x = dx.data(), p.x_type = DType::F32, p.ld_x = ld;
    p.weight = dw.data(), p.eps = 1e-6f, p.N = N, p.D = D;
    k3::norm::cuda::rmsnorm_forward(p);
    kc::synchronize();
    std::string bad;
    const auto got = out.rows(N, D, ld, &bad);
    ASSERT_TRUE(bad.empty()) << bad;
    EXPECT_LE(k3test::rel_l2(got, ref), kTolBf16);
  }
  // In place, fp32.
  {
    kc::DeviceBuffer<float> dx(x.data(), x.size());
    kc::DeviceBuffer<float> dw(w.data(), w.size());
    k3::norm::cuda::RmsNormParams p;
    p.y = dx.data(), p.y_type = DType::F32, p.ld_y = ld, p.x = dx.data(), p.x_type = DType::F32, p.ld_x = ld;
    p.weight = dw.data(), p.eps = 1e-6f, p.N = N, p.D = D;
    k3::norm::cuda::rmsnorm_forward(p);
    std::vector<float> back(x.size());
    dx.download(back.data(), back.size());
    std::vector<float> got(size_t(N * D));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < ld; ++d) {
        if (d < D) got[size_t(i * D + d)] = back[size_t(i * ld + d)];
        else ASSERT_EQ(back[size_t(i * ld + d)], x[size_t(i * ld + d)]) << "padding changed at row " << i;
      }
    EXPECT_LE(k3test::rel_l2(got, ref), kTolF32);
  }
}

TEST(CudaDense, RmsNormRejectsWhatItCannotRun) {
  K3_REQUIRE_GPU();
  k3::norm::cuda::RmsNormParams p;
  p.N = 1, p.D = 40000;
  kc::DeviceBuffer<float> b(40000);
  p.x = p.y = b.data();
  EXPECT_NE(k3::norm::cuda::can_run(p).find("register-resident row limit"), std::string::npos)
      << k3::norm::cuda::can_run(p);
  EXPECT_THROW(k3::norm::cuda::rmsnorm_forward(p), k3::Error);
  p.D = 16, p.x_type = DType::I64;
  EXPECT_NE(k3::norm::cuda::can_run(p).find("F32 or BF16"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// SiTU-GLU

TEST(CudaDense, GluMatchesCpu) {
  K3_REQUIRE_GPU();
  const DType types[] = {DType::F32, DType::BF16};
  for (int64_t rows : {int64_t(1), int64_t(37)})
    for (int64_t cols : {int64_t(128), int64_t(7168), int64_t(130)})
      for (DType tin : types)
        for (DType tout : types)
          for (bool situ : {true, false}) {
            const std::string ctx = "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) + " " +
                                    tname(tin) + "->" + tname(tout) + (situ ? " situ" : " swiglu");
            auto g = randf(rows * cols, 300 + uint64_t(cols), 4.0);
            auto u = randf(rows * cols, 400 + uint64_t(cols), 30.0);
            // Saturation and overflow-safety points of the sigmoid and both tanh caps.
            const float extremes[] = {-1e4f, -100.0f, -30.0f, -4.0f, 0.0f, 4.0f, 30.0f, 100.0f, 1e4f};
            for (size_t i = 0; i < 9 && i * 11 + 1 < g.size(); ++i) {
              g[i * 11] = extremes[i];
              u[i * 11 + 1] = extremes[8 - i];
            }
            if (tin == DType::BF16) g = bf16_round(g), u = bf16_round(u);
            k3::GluParams act;
            act.situ = situ;
            act.beta_gate = 4.0f, act.beta_up = 25.0f;
            std::vector<float> ref(g.size());
            k3::glu_forward(ref.data(), g.data(), u.data(), int64_t(g.size()), act);
            // gate | up side by side in one [rows, 2*cols] buffer: the fused GEMM's output layout.
            std::vector<float> fused(size_t(rows * 2 * cols));
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < cols; ++c) {
                fused[size_t(r * 2 * cols + c)] = g[size_t(r * cols + c)];
                fused[size_t(r * 2 * cols + cols + c)] = u[size_t(r * cols + c)];
              }
            DevIn din(fused, tin);
            GuardedOut out(size_t(rows * cols), tout);
            k3::ffn::cuda::GluLaunch p;
            p.out = out.data(), p.out_type = tout;
            p.gate = din.data();
            p.up = static_cast<uint8_t*>(din.data()) + size_t(cols) * k3::dtype_size(tin);
            p.in_type = tin, p.ld_in = 2 * cols, p.rows = rows, p.cols = cols, p.act = act;
            ASSERT_EQ(k3::ffn::cuda::can_run(p), "") << ctx;
            k3::ffn::cuda::glu_forward(p);
            kc::synchronize();
            std::string bad;
            const auto got = out.values(&bad);
            ASSERT_TRUE(bad.empty()) << bad << " " << ctx;
            EXPECT_LE(k3test::rel_l2(got, ref), tol_for(tout)) << ctx;
          }
}

TEST(CudaDense, GluInPlaceContiguous) {
  K3_REQUIRE_GPU();
  const int64_t n = 100003;
  auto g = randf(n, 51, 5.0), u = randf(n, 52, 20.0);
  k3::GluParams act;
  std::vector<float> ref(static_cast<size_t>(n));
  k3::glu_forward(ref.data(), g.data(), u.data(), n, act);
  kc::DeviceBuffer<float> dg(g.data(), g.size()), du(u.data(), u.size());
  k3::ffn::cuda::glu_forward(dg.data(), dg.data(), du.data(), n, act);
  std::vector<float> got(static_cast<size_t>(n));
  dg.download(got.data(), got.size());
  EXPECT_LE(k3test::rel_l2(got, ref), kTolF32);
}

// The SiTU betas take different code paths (a power-of-two beta divides by multiplying with its
// exact reciprocal, any other by the IEEE division): every combination against the CPU twin, on the
// 16-byte path and the scalar one, with a multi-row strided layout.
TEST(CudaDense, GluSituBetaForms) {
  K3_REQUIRE_GPU();
  const float betas[][2] = {{4.0f, 25.0f}, {2.0f, 8.0f}, {3.0f, 7.0f}, {0.5f, 1.0f}, {1.5f, 0.25f}};
  for (const auto& b : betas)
    for (int64_t cols : {int64_t(7168), int64_t(130)})
      for (DType t : {DType::F32, DType::BF16}) {
        const int64_t rows = 5;
        const std::string ctx = "betas " + std::to_string(b[0]) + "," + std::to_string(b[1]) +
                                " cols=" + std::to_string(cols) + " " + tname(t);
        auto g = randf(rows * cols, 700 + uint64_t(cols), 6.0);
        auto u = randf(rows * cols, 800 + uint64_t(cols), 20.0);
        if (t == DType::BF16) g = bf16_round(g), u = bf16_round(u);
        k3::GluParams act;
        act.beta_gate = b[0], act.beta_up = b[1];
        std::vector<float> ref(g.size());
        k3::glu_forward(ref.data(), g.data(), u.data(), int64_t(g.size()), act);
        std::vector<float> fused(size_t(rows * 2 * cols));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            fused[size_t(r * 2 * cols + c)] = g[size_t(r * cols + c)];
            fused[size_t(r * 2 * cols + cols + c)] = u[size_t(r * cols + c)];
          }
        DevIn din(fused, t);
        GuardedOut out(size_t(rows * cols), t);
        k3::ffn::cuda::GluLaunch p;
        p.out = out.data(), p.out_type = t, p.gate = din.data();
        p.up = static_cast<uint8_t*>(din.data()) + size_t(cols) * k3::dtype_size(t);
        p.in_type = t, p.ld_in = 2 * cols, p.rows = rows, p.cols = cols, p.act = act;
        k3::ffn::cuda::glu_forward(p);
        kc::synchronize();
        std::string bad;
        const auto got = out.values(&bad);
        ASSERT_TRUE(bad.empty()) << bad << " " << ctx;
        EXPECT_LE(k3test::rel_l2(got, ref), tol_for(t)) << ctx;
      }
}

// ---------------------------------------------------------------------------------------------
// Fused Block AttnRes (+ RMSNorm)

struct AttnResCase {
  int S;
  int64_t N, D;
  DType src, out;
  bool want_out, want_norm, norm_weight;
  double query_scale;  // scores ~ N(0, query_scale²·D)
};

void run_attnres_case(const AttnResCase& c, uint64_t seed) {
  const std::string ctx = "S=" + std::to_string(c.S) + " N=" + std::to_string(c.N) + " D=" + std::to_string(c.D) + " " +
                          tname(c.src) + "->" + tname(c.out) + (c.want_out ? " out" : "") +
                          (c.want_norm ? (c.norm_weight ? " norm(w)" : " norm") : "") +
                          " qscale=" + std::to_string(c.query_scale);
  SCOPED_TRACE(ctx);
  const int64_t ND = c.N * c.D;
  std::vector<std::vector<float>> src(size_t(c.S));
  for (int i = 0; i < c.S; ++i) {
    // Sources of very different sizes, as block sums are (the keys are RMS-normalised; the values are not).
    src[size_t(i)] = randf(ND, seed * 31 + uint64_t(i), std::pow(4.0, double(i % 4) - 1.0));
    if (c.src == DType::BF16) src[size_t(i)] = bf16_round(src[size_t(i)]);
  }
  const auto q = randf(c.D, seed * 31 + 99, c.query_scale);
  auto nw = randf(c.D, seed * 31 + 98, 0.2);
  for (auto& e : nw) e += 1.0f;
  const float eps = 1e-5f, norm_eps = 1e-5f;

  // CPU twin: AttnRes, then (on h as stored in the output dtype) RMSNorm.
  std::vector<const float*> ptrs;
  for (auto& s : src) ptrs.push_back(s.data());
  std::vector<float> h(static_cast<size_t>(ND));
  k3::attnres_forward(h.data(), ptrs.data(), c.S, c.N, c.D, q.data(), eps);
  std::vector<float> hs = c.out == DType::BF16 ? bf16_round(h) : h;
  std::vector<float> y(static_cast<size_t>(ND));
  k3::rmsnorm_forward(y.data(), hs.data(), c.norm_weight ? nw.data() : nullptr, norm_eps, c.N, c.D);

  std::vector<DevIn> dsrc;
  dsrc.reserve(size_t(c.S));
  for (auto& s : src) dsrc.emplace_back(s, c.src);
  kc::DeviceBuffer<float> dq(q.data(), q.size()), dnw(nw.data(), nw.size());
  GuardedOut out(size_t(ND), c.out), normed(size_t(ND), c.out);
  k3::attnres::cuda::AttnResParams p;
  for (int i = 0; i < c.S; ++i) p.sources[i] = dsrc[size_t(i)].data();
  p.S = c.S, p.src_type = c.src, p.N = c.N, p.D = c.D, p.query = dq.data(), p.eps = eps;
  p.out_type = c.out;
  p.out = c.want_out ? out.data() : nullptr;
  p.normed = c.want_norm ? normed.data() : nullptr;
  p.norm_weight = c.norm_weight ? dnw.data() : nullptr;
  p.norm_eps = norm_eps;
  ASSERT_EQ(k3::attnres::cuda::can_run(p), "");
  k3::attnres::cuda::attnres_forward(p);
  kc::synchronize();
  std::string bad;
  if (c.want_out) {
    const auto got = out.values(&bad);
    ASSERT_TRUE(bad.empty()) << bad << " (out)";
    EXPECT_LE(k3test::rel_l2(got, h), tol_for(c.out)) << "out";
  } else {
    const auto r = out.raw();
    for (size_t i = 0; i < r.size(); ++i) ASSERT_EQ(r[i], 0xFF) << "out written although null";
  }
  if (c.want_norm) {
    const auto got = normed.values(&bad);
    ASSERT_TRUE(bad.empty()) << bad << " (normed)";
    EXPECT_LE(k3test::rel_l2(got, y), tol_for(c.out)) << "normed";
  }
}

TEST(CudaDense, AttnResMatchesCpuAllSourceCounts) {
  K3_REQUIRE_GPU();
  const DType types[] = {DType::F32, DType::BF16};
  uint64_t seed = 1;
  for (int S = 1; S <= 9; ++S)
    for (int64_t D : {int64_t(128), int64_t(7168), int64_t(130)})
      for (DType ts : types)
        for (DType to : types) {
          const int64_t N = (S % 2) ? 37 : 1;
          run_attnres_case({S, N, D, ts, to, true, true, true, 2.0 / std::sqrt(double(D))}, seed++);
        }
}

TEST(CudaDense, AttnResOutputsAndPeakedSoftmax) {
  K3_REQUIRE_GPU();
  uint64_t seed = 1000;
  for (DType to : {DType::F32, DType::BF16}) {
    // Only the normed rows (the decoder's use), with and without a norm weight; only h (no norm).
    run_attnres_case({9, 37, 7168, DType::F32, to, false, true, true, 2.0 / std::sqrt(7168.0)}, seed++);
    run_attnres_case({9, 37, 7168, DType::F32, to, false, true, false, 2.0 / std::sqrt(7168.0)}, seed++);
    run_attnres_case({5, 37, 7168, DType::F32, to, true, false, false, 2.0 / std::sqrt(7168.0)}, seed++);
    // A peaked softmax (score std 8: weights spanning e^±40): the online max must rescale correctly.
    // (fp32 score error grows with |s|, ~|s|·3e-7; std 8 keeps the expected error ~10x under 1e-5.)
    run_attnres_case({9, 37, 7168, DType::F32, to, true, true, true, 8.0 / std::sqrt(7168.0)}, seed++);
    run_attnres_case({8, 5, 1000, DType::BF16, to, true, true, true, 8.0 / std::sqrt(1000.0)}, seed++);
  }
}

TEST(CudaDense, AttnResRowLengthsAndManyRows) {
  K3_REQUIRE_GPU();
  uint64_t seed = 2000;
  // The longest row (16384), rows whose slices do not fill every thread's packs, BF16 sources on the
  // 16-byte path and on the scalar path (D % 8 != 0), and enough rows that blocks share the SMs.
  for (DType ts : {DType::F32, DType::BF16})
    for (DType to : {DType::F32, DType::BF16}) {
      run_attnres_case({9, 3, 16384, ts, to, true, true, true, 2.0 / std::sqrt(16384.0)}, seed++);
      run_attnres_case({4, 7, 5000, ts, to, true, true, false, 2.0 / std::sqrt(5000.0)}, seed++);
      run_attnres_case({3, 5, 7172, ts, to, false, true, true, 2.0 / std::sqrt(7172.0)}, seed++);
      run_attnres_case({2, 9, 8, ts, to, true, false, false, 2.0 / std::sqrt(8.0)}, seed++);
    }
  run_attnres_case({9, 400, 7168, DType::BF16, DType::BF16, true, true, true, 2.0 / std::sqrt(7168.0)}, seed++);
  run_attnres_case({6, 400, 7168, DType::F32, DType::BF16, false, true, true, 2.0 / std::sqrt(7168.0)}, seed++);
}

// The pending residual update done by the mix (last_addend / last_store): the same bits as add_inplace (or a
// copy) and then the mix, on rows the fused kernel takes (512, 98 floats) and rows that take the separate launch
// (7168).
TEST(CudaDense, AttnResDoesThePendingUpdate) {
  K3_REQUIRE_GPU();
  namespace ar = k3::attnres::cuda;
  uint64_t seed = 3000;
  for (const int64_t D : {int64_t(512), int64_t(98), int64_t(7168)})
    for (const bool add : {true, false}) {
      SCOPED_TRACE("D " + std::to_string(D) + (add ? " add" : " copy"));
      const int64_t N = 3, ND = N * D;
      const int S = 4;
      std::vector<std::vector<float>> src;
      for (int i = 0; i < S; ++i) src.push_back(randf(ND, seed++, 1.0 + i));
      const auto addend = randf(ND, seed++, 0.5), q = randf(D, seed++, 2.0 / std::sqrt(double(D)));
      kc::DeviceBuffer<float> dq(q.data(), q.size()), dadd(addend.data(), addend.size());
      auto run = [&](bool fused, std::vector<float>& normed, std::vector<float>& last) {
        std::vector<kc::DeviceBuffer<float>> d;
        for (const auto& v : src) d.emplace_back(v.data(), v.size());
        kc::DeviceBuffer<float> store(static_cast<size_t>(ND)), y(static_cast<size_t>(ND));
        ar::AttnResParams p;
        for (int i = 0; i < S; ++i) p.sources[i] = d[size_t(i)].data();
        p.S = S, p.N = N, p.D = D, p.query = dq.data(), p.normed = y.data();
        float* target = add ? d[size_t(S - 1)].data() : store.data();
        if (fused) {
          p.last_store = target, p.last_addend = add ? dadd.data() : nullptr;
        } else {
          if (add) k3::elementwise::cuda::add_inplace(target, dadd.data(), ND);
          else kc::copy_on_device(target, d[size_t(S - 1)].data(), size_t(ND) * 4);
          p.sources[S - 1] = target;
        }
        ASSERT_EQ(ar::can_run(p), "");
        ar::attnres_forward(p);
        normed.resize(size_t(ND)), last.resize(size_t(ND));
        y.download(normed.data(), normed.size());
        kc::copy_to_host(last.data(), target, size_t(ND) * 4);
      };
      std::vector<float> y0, l0, y1, l1;
      run(false, y0, l0);
      run(true, y1, l1);
      EXPECT_EQ(y1, y0);
      EXPECT_EQ(l1, l0);
    }
  kc::DeviceBuffer<float> b(64);
  ar::AttnResParams p;
  p.S = 2, p.N = 1, p.D = 16, p.sources[0] = b.data(), p.sources[1] = b.data() + 16, p.query = b.data();
  p.normed = b.data() + 32, p.last_addend = b.data() + 48;
  EXPECT_NE(ar::can_run(p).find("without last_store"), std::string::npos);
  p.last_store = b.data() + 32;
  EXPECT_NE(ar::can_run(p).find("must be it"), std::string::npos);
}

TEST(CudaDense, AttnResRejectsWhatItCannotRun) {
  K3_REQUIRE_GPU();
  k3::attnres::cuda::AttnResParams p;
  p.N = 1, p.D = 16;
  EXPECT_NE(k3::attnres::cuda::can_run(p).find("S = 0"), std::string::npos) << k3::attnres::cuda::can_run(p);
  p.S = 17;
  EXPECT_NE(k3::attnres::cuda::can_run(p).find("S = 17"), std::string::npos);
  p.S = 1;
  kc::DeviceBuffer<float> b(16);
  p.sources[0] = b.data(), p.query = b.data();
  EXPECT_NE(k3::attnres::cuda::can_run(p).find("neither out nor normed"), std::string::npos);
  EXPECT_THROW(k3::attnres::cuda::attnres_forward(p), k3::Error);
}

// ---------------------------------------------------------------------------------------------
// GEMM

struct GemmCase {
  int64_t M, N, K;
  int64_t pad_x = 0, pad_y = 0;  // row strides K + pad_x, N + pad_y
  bool accumulate = false;
};

std::string gemm_ctx(const GemmCase& g, DType in, DType out, k3::gemm::cuda::GemmBackend b) {
  const char* bn = b == k3::gemm::cuda::GemmBackend::Auto ? "auto"
                   : b == k3::gemm::cuda::GemmBackend::Lt ? "lt"
                                                          : "classic";
  return "M=" + std::to_string(g.M) + " N=" + std::to_string(g.N) + " K=" + std::to_string(g.K) +
         " pad_x=" + std::to_string(g.pad_x) + " pad_y=" + std::to_string(g.pad_y) + (g.accumulate ? " acc " : " ") +
         tname(in) + "->" + tname(out) + " " + bn;
}

// Runs one GEMM case on the GPU and the CPU twin (fp64 accumulation). Returns the relative L2 error,
// or +inf (with a message) when guards or padding were touched.
double run_gemm(k3::gemm::cuda::GemmContext& ctx, const GemmCase& g, DType in, DType out,
                k3::gemm::cuda::GemmBackend backend, const std::vector<float>& x_in, const std::vector<float>& w_in,
                std::vector<float>* got_out = nullptr, std::vector<float>* ref_out = nullptr, bool integer_y0 = false) {
  const int64_t ldx = g.K + g.pad_x, ldy = g.N + g.pad_y;
  // Operands as the GPU sees them (bf16-rounded for BF16), dense copies for the CPU twin.
  std::vector<float> x = x_in, w = w_in;
  if (in == DType::BF16) x = bf16_round(x), w = bf16_round(w);
  std::vector<float> xd(size_t(g.M * g.K));
  for (int64_t i = 0; i < g.M; ++i)
    for (int64_t k = 0; k < g.K; ++k) xd[size_t(i * g.K + k)] = x[size_t(i * ldx + k)];
  // Initial y (accumulate): representable in the output dtype.
  auto y0 = randf(g.M * ldy, 77 + uint64_t(g.M * g.N), 1.0);
  if (integer_y0)
    for (auto& e : y0) e = std::round(8.0f * e);
  if (out == DType::BF16) y0 = bf16_round(y0);
  std::vector<float> ref(size_t(g.M * g.N));
  for (int64_t i = 0; i < g.M; ++i)
    for (int64_t j = 0; j < g.N; ++j) ref[size_t(i * g.N + j)] = y0[size_t(i * ldy + j)];
  k3::WeightRef W;
  std::vector<uint16_t> wb;
  if (in == DType::BF16) {
    wb = to_bf16(w);
    W.format = k3::WeightRef::Format::BF16, W.data = wb.data();
  } else {
    W.format = k3::WeightRef::Format::F32, W.data = w.data();
  }
  W.rows = g.N, W.cols = g.K;
  {
    const F64LinearsScope f64;
    k3::linear_forward(ref.data(), g.N, xd.data(), g.K, g.M, W, g.accumulate);
  }

  DevIn dx(x, in), dw(w, in);
  GuardedOut dy(size_t(g.M * ldy), out);
  if (g.accumulate) {  // y0 into the output (padding columns stay 0xFF)
    auto r = dy.raw();
    for (int64_t i = 0; i < g.M; ++i)
      for (int64_t j = 0; j < g.N; ++j) {
        uint8_t* p = r.data() + GuardedOut::kGuard + size_t(i * ldy + j) * k3::dtype_size(out);
        const float v = y0[size_t(i * ldy + j)];
        if (out == DType::BF16) {
          const uint16_t h = k3::f32_to_bf16(v);
          std::memcpy(p, &h, 2);
        } else {
          std::memcpy(p, &v, 4);
        }
      }
    dy.buf.upload(r.data(), r.size());
  }
  k3::gemm::cuda::LinearParams p;
  p.y = dy.data(), p.y_type = out, p.ld_y = ldy, p.x = dx.data(), p.ld_x = ldx, p.w = dw.data(), p.in_type = in;
  p.M = g.M, p.N = g.N, p.K = g.K, p.accumulate = g.accumulate, p.backend = backend;
  const std::string why = k3::gemm::cuda::can_run(p);
  EXPECT_EQ(why, "");
  if (!why.empty()) return INFINITY;
  k3::gemm::cuda::linear_forward(ctx, p);
  kc::synchronize();
  std::string bad;
  const auto got = dy.rows(g.M, g.N, ldy, &bad);
  EXPECT_TRUE(bad.empty()) << bad;
  if (!bad.empty()) return INFINITY;
  if (got_out) *got_out = got;
  if (ref_out) *ref_out = ref;
  return k3test::rel_l2(got, ref);
}

TEST(CudaDense, GemmBf16MatchesCpu) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  using B = k3::gemm::cuda::GemmBackend;
  const GemmCase cases[] = {
      {1, 128, 128},    // decode row
      {37, 300, 7168},  // rows not a multiple of any tile; hidden 7168
      {5, 1000, 130},   // K not a multiple of 8: no 16-byte rows
      {64, 7168, 128},
      {37, 129, 7168, 8, 3},        // strided x and y, odd N
      {37, 256, 7168, 0, 0, true},  // accumulate
      {3, 136, 1000, 24, 8, true},  // strided accumulate
  };
  uint64_t seed = 500;
  for (const auto& g : cases)
    for (DType out : {DType::F32, DType::BF16})
      for (B b : {B::Auto, B::Classic}) {
        const auto x = randf(g.M * (g.K + g.pad_x), seed++, 1.0);
        const auto w = randf(g.N * g.K, seed++, 1.0 / std::sqrt(double(g.K)));
        const double e = run_gemm(ctx, g, DType::BF16, out, b, x, w);
        EXPECT_LE(e, out == DType::BF16 ? kTolBf16 : kTolGemmBf16F32) << gemm_ctx(g, DType::BF16, out, b);
      }
  // cuBLASLt forced, on shapes with 16-byte rows (it must have an algorithm there).
  for (const GemmCase& g : {GemmCase{37, 300, 7168}, GemmCase{64, 7168, 128}, GemmCase{37, 256, 7168, 0, 0, true}}) {
    const auto x = randf(g.M * g.K, seed++, 1.0);
    const auto w = randf(g.N * g.K, seed++, 1.0 / std::sqrt(double(g.K)));
    const double e = run_gemm(ctx, g, DType::BF16, DType::F32, B::Lt, x, w);
    EXPECT_LE(e, kTolGemmBf16F32) << gemm_ctx(g, DType::BF16, DType::F32, B::Lt);
  }
}

// Several linears of a few rows in one launch (linear_rows_cuda.h): each output against the fp64 CPU twin,
// guards and padding untouched; a row's bits the same whatever M (a sequence alone or in a batch).
TEST(CudaDense, LinearRowsMatchCpuAndRowsAreIndependent) {
  K3_REQUIRE_GPU();
  namespace g = k3::gemm::cuda;
  uint64_t seed = 700;
  for (const int64_t K : {int64_t(40), int64_t(512), int64_t(7168)}) {
    const int64_t M = 8, ldx = K + 8;
    struct Out {
      int64_t N, ld;
      DType t;
    };
    const std::vector<Out> outs = {{136, 136, DType::BF16}, {8, 11, DType::F32}, {1000, 1000, DType::F32}};
    const auto x = bf16_round(randf(M * ldx, seed++, 1.0));
    DevIn dx(x, DType::BF16);
    std::vector<std::vector<float>> w;
    std::vector<DevIn> dw;
    for (const Out& o : outs) {
      w.push_back(bf16_round(randf(o.N * K, seed++, 1.0 / std::sqrt(double(K)))));
      dw.emplace_back(w.back(), DType::BF16);
    }
    auto run = [&](int64_t m0, int64_t rows, std::vector<GuardedOut>& y) {
      std::vector<g::LinearRowsOutput> ro;
      for (size_t i = 0; i < outs.size(); ++i) {
        y.emplace_back(size_t(rows * outs[i].ld), outs[i].t);
        g::LinearRowsOutput l;
        l.w = static_cast<const uint16_t*>(dw[i].data()), l.N = outs[i].N, l.y = y.back().data(), l.y_type = outs[i].t;
        l.ld_y = outs[i].ld;
        ro.push_back(l);
      }
      const auto* xp = static_cast<const uint16_t*>(dx.data()) + m0 * ldx;
      ASSERT_EQ(g::linear_rows_can_run(xp, ldx, rows, K, ro.data(), int(ro.size())), "");
      g::linear_rows(xp, ldx, rows, K, ro.data(), int(ro.size()));
      kc::synchronize();
    };
    std::vector<GuardedOut> all, one, three;
    run(0, M, all);
    run(5, 1, one);    // row 5 alone
    run(2, 3, three);  // rows 2..4
    for (size_t i = 0; i < outs.size(); ++i) {
      const Out& o = outs[i];
      std::vector<float> ref(size_t(M * o.N));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < o.N; ++n) {
          double s = 0.0;
          for (int64_t k = 0; k < K; ++k) s += double(x[size_t(m * ldx + k)]) * double(w[i][size_t(n * K + k)]);
          ref[size_t(m * o.N + n)] = float(s);
        }
      std::string bad;
      const auto got = all[i].rows(M, o.N, o.ld, &bad);
      EXPECT_TRUE(bad.empty()) << bad << " K " << K << " output " << i;
      EXPECT_LE(k3test::rel_l2(got, ref), o.t == DType::BF16 ? kTolBf16 : kTolGemmBf16F32)
          << "K " << K << " output " << i;
      const auto r1 = one[i].rows(1, o.N, o.ld, &bad);
      const auto r3 = three[i].rows(3, o.N, o.ld, &bad);
      EXPECT_TRUE(bad.empty()) << bad;
      EXPECT_EQ(r1, std::vector<float>(got.begin() + 5 * o.N, got.begin() + 6 * o.N)) << "K " << K << " output " << i;
      EXPECT_EQ(r3, std::vector<float>(got.begin() + 2 * o.N, got.begin() + 5 * o.N)) << "K " << K << " output " << i;
    }
  }
  // What it cannot run is refused with the reason.
  DevIn dx(std::vector<float>(64 * 16, 0.5f), DType::BF16);
  const auto* xp = static_cast<const uint16_t*>(dx.data());
  GuardedOut y(64, DType::F32);
  g::LinearRowsOutput o;
  o.w = xp, o.N = 4, o.y = y.data(), o.y_type = DType::F32;
  EXPECT_EQ(g::linear_rows_can_run(xp, 16, 2, 16, &o, 1), "");
  EXPECT_NE(g::linear_rows_can_run(xp, 16, 9, 16, &o, 1).find("M = 9"), std::string::npos);
  EXPECT_NE(g::linear_rows_can_run(xp, 12, 2, 12, &o, 1).find("K = 12"), std::string::npos);
  EXPECT_NE(g::linear_rows_can_run(xp + 1, 16, 2, 16, &o, 1).find("aligned"), std::string::npos);
  EXPECT_NE(g::linear_rows_can_run(xp, 16, 2, 16, &o, 0).find("outputs"), std::string::npos);
  EXPECT_THROW(g::linear_rows(xp, 8, 2, 16, &o, 1), k3::Error);
}

TEST(CudaDense, GemmF32ExactIsNotTf32) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  using B = k3::gemm::cuda::GemmBackend;
  // Random data: TF32 (10-bit mantissa) would be ~1e-3 off; plain fp32 is ~1e-7..5e-7 at these K.
  const GemmCase cases[] = {{1, 128, 128}, {37, 129, 1000}, {5, 1000, 130, 3, 5}, {37, 256, 1000, 0, 0, true}};
  uint64_t seed = 900;
  for (const auto& g : cases) {
    const auto x = randf(g.M * (g.K + g.pad_x), seed++, 1.0);
    const auto w = randf(g.N * g.K, seed++, 1.0 / std::sqrt(double(g.K)));
    const double e = run_gemm(ctx, g, DType::F32, DType::F32, B::Auto, x, w);
    EXPECT_LE(e, kTolGemmF32) << gemm_ctx(g, DType::F32, DType::F32, B::Auto);
  }
}

TEST(CudaDense, GemmF32ExactIntegerDataIsExactAtHidden7168) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  // Integers in [-8, 8]: every product and partial sum (|sum| <= 64·7168 < 2^24) is exact in fp32,
  // so any summation order gives the exact result: a layout or stride error cannot hide in rounding.
  for (const GemmCase& g :
       {GemmCase{37, 129, 7168}, GemmCase{4, 7168, 7168, 16, 0}, GemmCase{19, 300, 7168, 0, 0, true}}) {
    const int64_t n_x = g.M * (g.K + g.pad_x), n_w = g.N * g.K;
    std::vector<float> x(static_cast<size_t>(n_x)), w(static_cast<size_t>(n_w));
    uint64_t s = 12345;
    auto next = [&] {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      return float(int64_t((s >> 33) % 17) - 8);
    };
    for (auto& e : x) e = next();
    for (auto& e : w) e = next();
    std::vector<float> got, ref;
    run_gemm(ctx, g, DType::F32, DType::F32, k3::gemm::cuda::GemmBackend::Auto, x, w, &got, &ref, /*integer_y0=*/true);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], ref[i]) << "element " << i << " "
                                << gemm_ctx(g, DType::F32, DType::F32, k3::gemm::cuda::GemmBackend::Auto);
  }
}

TEST(CudaDense, GemmEdgeShapesAndErrors) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  // K = 0: y = 0 (or unchanged when accumulating).
  {
    GuardedOut y(size_t(3 * 5), DType::F32);
    k3::gemm::cuda::LinearParams p;
    p.y = y.data(), p.y_type = DType::F32, p.in_type = DType::BF16, p.M = 3, p.N = 5, p.K = 0;
    k3::gemm::cuda::linear_forward(ctx, p);
    kc::synchronize();
    std::string bad;
    const auto v = y.values(&bad);
    ASSERT_TRUE(bad.empty()) << bad;
    for (float e : v) EXPECT_EQ(e, 0.0f);
  }
  k3::gemm::cuda::LinearParams p;
  p.in_type = DType::F32, p.y_type = DType::BF16, p.M = p.N = p.K = 4;
  EXPECT_NE(k3::gemm::cuda::can_run(p).find("supported are"), std::string::npos) << k3::gemm::cuda::can_run(p);
  EXPECT_THROW(k3::gemm::cuda::linear_forward(ctx, p), k3::Error);
  p.in_type = DType::BF16, p.y_type = DType::F32, p.ld_x = 2;
  EXPECT_NE(k3::gemm::cuda::can_run(p).find("row stride"), std::string::npos);
}

TEST(CudaDense, LmHeadIsTheBf16Gemm) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  const int64_t M = 3, V = 5003, D = 128;
  const auto x = to_bf16(randf(M * D, 61));
  const auto w = to_bf16(randf(V * D, 62, 0.1));
  k3::WeightRef W;
  W.format = k3::WeightRef::Format::BF16, W.data = w.data(), W.rows = V, W.cols = D;
  const auto xf = widen(x);
  std::vector<float> ref(size_t(M * V));
  {
    const F64LinearsScope f64;
    k3::linear_forward(ref.data(), xf.data(), M, W);
  }
  kc::DeviceBuffer<uint16_t> dx(x.data(), x.size()), dw(w.data(), w.size());
  GuardedOut out(size_t(M * V), DType::F32);
  k3::gemm::cuda::lm_head_forward(ctx, static_cast<float*>(out.data()), dx.data(), dw.data(), M, V, D);
  kc::synchronize();
  std::string bad;
  const auto got = out.values(&bad);
  ASSERT_TRUE(bad.empty()) << bad;
  EXPECT_LE(k3test::rel_l2(got, ref), kTolGemmBf16F32);
}

}  // namespace

#else  // no CUDA backend in this build: nothing to link against

TEST(CudaDense, NeedsTheCudaBackend) { GTEST_SKIP() << "this build has no CUDA backend"; }

#endif
