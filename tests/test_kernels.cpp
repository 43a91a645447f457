// Tests for the small CPU kernels: linear layers over F32/BF16/F16/MXFP4 weights (src/kernels/gemm), MXFP4
// decoding and encoding, the sigmoid router (src/kernels/moe), Block AttnRes (src/kernels/attnres), RMSNorm
// and the gated activations (src/kernels/norm, src/kernels/ffn). Every kernel is compared with a reference
// written plainly here in double precision, on deterministic data; tolerances are derived from the
// precision each kernel promises (see the comment above each constant), never fitted to the results.
// Each test prints its worst measured error as a fraction of its tolerance ("[worst] ...").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "kernels/attnres/attnres.h"
#include "kernels/ffn/glu.h"
#include "kernels/gemm/linear.h"
#include "kernels/gemm/mxfp4.h"
#include "kernels/moe/router.h"
#include "kernels/norm/norm.h"
#include "model/init_random.h"

namespace {

using k3::GemmPrecision;
using k3::WeightRef;
using Fmt = WeightRef::Format;

constexpr double kU = 0x1p-24;          // fp32 unit roundoff (half an ulp, relative)
constexpr double kUd = 0x1p-53;         // fp64 unit roundoff
constexpr float kSentinel = -7777.25f;  // written in padding columns that a kernel must not touch

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::F32: return "F32";
    case Fmt::BF16: return "BF16";
    case Fmt::F16: return "F16";
    case Fmt::MXFP4: return "MXFP4";
  }
  return "?";
}
const char* prec_name(GemmPrecision p) { return p == GemmPrecision::F64Accumulate ? "f64acc" : "f32"; }

// Largest err/tol seen by one test, printed when the test ends (for the summary), with where it happened.
struct Worst {
  std::string what;
  double ratio = 0.0, err = 0.0, tol = 0.0;
  std::string where;
  explicit Worst(std::string w) : what(std::move(w)) {}
  // `at` is a string or a callable returning one (only called when this is the new worst).
  template <class At>
  void see(double e, double t, At&& at) {
    const double r = t > 0 ? e / t : (e > 0 ? INFINITY : 0.0);
    if (r > ratio || where.empty()) {
      ratio = r;
      err = e;
      tol = t;
      if constexpr (std::is_invocable_v<At>) where = at();
      else where = at;
    }
  }
  ~Worst() {
    std::printf("[worst] %s: err/tol = %.3g (err %.3g, tol %.3g) at %s\n", what.c_str(), ratio, err, tol,
                where.c_str());
  }
};

// Restores the process-wide GEMM precision on scope exit.
struct PrecisionGuard {
  GemmPrecision saved = k3::gemm_precision();
  ~PrecisionGuard() { k3::set_gemm_precision(saved); }
};

std::vector<float> normal_vec(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ---------------------------------------------------------------------------------------------------------
// Independent decoders / encoders (plain code, not the engine's).

double ref_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double ref_f16(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = std::ldexp(double(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return sign ? -v : v;
}

// f16 bits of a value that f16 represents exactly (normal or subnormal); throws otherwise.
uint16_t f16_encode_exact(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
  const int E = e - 1;
  double man;
  uint16_t bits;
  if (E >= -14) {
    if (E > 15) throw std::logic_error("f16 overflow");
    man = (a / std::ldexp(1.0, E) - 1.0) * 1024.0;
    bits = uint16_t(((E + 15) << 10) | int(man));
  } else {
    man = a * 0x1p24;
    bits = uint16_t(man);
  }
  if (man != std::floor(man)) throw std::logic_error("value not exactly representable in f16");
  const uint16_t h = uint16_t(sign | bits);
  if (ref_f16(h) != v) throw std::logic_error("f16 encoder self-check failed");
  return h;
}

constexpr double kE2M1Ref[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
double ref_e2m1(int nib) { return (nib & 8 ? -1.0 : 1.0) * kE2M1Ref[nib & 7]; }
// Element c of an MXFP4 row: byte c/2, low nibble for even c; scale byte c/32; 255 is NaN.
double ref_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t c) {
  const uint8_t b = packed[c / 2];
  const int nib = (c % 2 == 0) ? (b & 0xf) : (b >> 4);
  const uint8_t s = scales[c / 32];
  if (s == 255) return NAN;
  return ref_e2m1(nib) * std::ldexp(1.0, int(s) - 127);
}

// ---------------------------------------------------------------------------------------------------------
// Test weights: the stored arrays plus the exact decoded matrix in double.

struct TestWeight {
  Fmt fmt = Fmt::F32;
  int64_t rows = 0, cols = 0;
  std::vector<float> f32;
  std::vector<uint16_t> h;
  std::vector<uint8_t> packed, scales;
  std::vector<double> ref;  // [rows, cols], what the stored bytes mean

  WeightRef view() const {
    WeightRef w;
    w.format = fmt;
    w.rows = rows;
    w.cols = cols;
    switch (fmt) {
      case Fmt::F32: w.data = f32.data(); break;
      case Fmt::BF16:
      case Fmt::F16: w.data = h.data(); break;
      case Fmt::MXFP4:
        w.data = packed.data();
        w.scales = scales.data();
        break;
    }
    return w;
  }
};

// Rows get different magnitudes (a power of two per row), so that a slice that forgot to move the MXFP4
// scales, or an off-by-one row, shows up as a wrong value rather than a lucky match.
TestWeight make_weight(Fmt fmt, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  TestWeight w;
  w.fmt = fmt;
  w.rows = rows;
  w.cols = cols;
  w.ref.resize(size_t(rows * cols));
  auto row_shift = [](int64_t r) { return int((r * 5) % 9) - 4; };
  switch (fmt) {
    case Fmt::F32:
      w.f32.resize(size_t(rows * cols));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float v = std::ldexp(nd(rng), row_shift(r));
          w.f32[size_t(r * cols + c)] = v;
          w.ref[size_t(r * cols + c)] = v;
        }
      break;
    case Fmt::BF16:
      w.h.resize(size_t(rows * cols));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t b = k3::f32_to_bf16(std::ldexp(nd(rng), row_shift(r)));
          w.h[size_t(r * cols + c)] = b;
          w.ref[size_t(r * cols + c)] = ref_bf16(b);
        }
      break;
    case Fmt::F16: {
      // m * 2^E with |m| < 2048: exact in f16. Mostly E = -11 + row shift (values ~ +-1), 1 in 8 at E = -24
      // (subnormals, exercising that branch of the decoder).
      w.h.resize(size_t(rows * cols));
      std::uniform_int_distribution<int> mant(-2047, 2047), pick(0, 7);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int E = pick(rng) == 0 ? -24 : -11 + row_shift(r);
          const double v = std::ldexp(double(mant(rng)), E);
          w.h[size_t(r * cols + c)] = f16_encode_exact(v);
          w.ref[size_t(r * cols + c)] = v;
        }
      break;
    }
    case Fmt::MXFP4: {
      w.packed.resize(size_t(rows * cols / 2));
      w.scales.resize(size_t(rows * cols / 32));
      std::vector<float> row(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        for (auto& v : row) v = std::ldexp(nd(rng), row_shift(r));
        k3::mxfp4_encode_row(&w.packed[size_t(r * cols / 2)], &w.scales[size_t(r * cols / 32)], row.data(), cols);
        for (int64_t c = 0; c < cols; ++c)
          w.ref[size_t(r * cols + c)] = ref_mxfp4(&w.packed[size_t(r * cols / 2)], &w.scales[size_t(r * cols / 32)], c);
      }
      break;
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------------------------
// 1. linear_forward

// One linear_forward call checked element by element against a double reference.
//  - fp64 accumulation: products of two floats are exact in double, the sum carries at most (In+1) fp64
//    roundings, then one rounding to fp32. So |got - ref| <= 2^-24 |ref| + 2 (In+2) 2^-53 mag, where
//    mag = |y0| + sum |w x| (the second term covers both the kernel's and the reference's fp64 sums).
//    This is "the double result rounded to float" up to ~1e-14 relative.
//  - fp32 accumulation: the classical dot-product bound gamma_{In+1} = (In+1) 2^-24 / (1 - ...) on mag,
//    plus the final rounding; holds for any summation order (SIMD reduction, FMA, BLAS blocking).
//    Beside this rigorous per-element bound, the relative L2 error of the whole output is checked against
//    the statistical (random-walk) size sqrt(In) 2^-24.
// Returns the relative L2 error of the call.
double check_linear_case(const TestWeight& W, int64_t N, int64_t ldx, int64_t ldy, bool acc, GemmPrecision prec,
                         uint32_t seed, Worst* worst_by_prec[2], Worst* worst_l2) {
  Worst& worst = *worst_by_prec[prec == GemmPrecision::F64Accumulate ? 0 : 1];
  const int64_t In = W.cols, Out = W.rows;
  std::ostringstream cs;
  cs << fmt_name(W.fmt) << " N=" << N << " Out=" << Out << " In=" << In << " ldx=" << ldx << " ldy=" << ldy
     << " acc=" << acc << " prec=" << prec_name(prec);
  const std::string cname = cs.str();

  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(N * ldx), NAN);  // padding columns NaN: reading them would poison y
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < In; ++i) x[size_t(n * ldx + i)] = nd(rng);
  std::vector<float> y(size_t(N * ldy), kSentinel);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < Out; ++o) y[size_t(n * ldy + o)] = acc ? 2.0f * nd(rng) : NAN;  // NaN: must be ignored
  const std::vector<float> y0 = y;

  k3::set_gemm_precision(prec);
  k3::linear_forward(y.data(), ldy, x.data(), ldx, N, W.view(), acc);

  int bad = 0;
  std::string first_bad;
  double num = 0.0, den = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < Out; ++o) {
      double s = acc ? double(y0[size_t(n * ldy + o)]) : 0.0;
      double mag = std::fabs(s);
      for (int64_t i = 0; i < In; ++i) {
        const double p = W.ref[size_t(o * In + i)] * double(x[size_t(n * ldx + i)]);
        s += p;
        mag += std::fabs(p);
      }
      const double got = y[size_t(n * ldy + o)];
      const double tol = prec == GemmPrecision::F64Accumulate
                             ? kU * std::fabs(s) + 2.0 * double(In + 2) * kUd * mag
                             : (double(In + 2) * kU * (1.0 + 1e-5) + 2.0 * double(In + 2) * kUd) * mag;
      const double err = std::isfinite(got) ? std::fabs(got - s) : INFINITY;
      auto at = [&] { return cname + " y[" + std::to_string(n) + "," + std::to_string(o) + "]"; };
      worst.see(err, tol, at);
      if (!(err <= tol) && bad++ == 0) first_bad = at() + " got " + std::to_string(got) + " ref " + std::to_string(s);
      num += (got - s) * (got - s);
      den += s * s;
    }
    for (int64_t o = Out; o < ldy; ++o)
      if (!same_bits(y[size_t(n * ldy + o)], kSentinel) && bad++ == 0)
        first_bad = cname + ": padding y[" + std::to_string(n) + "," + std::to_string(o) + "] was written";
  }
  EXPECT_EQ(bad, 0) << "first: " << first_bad;
  const double l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (prec == GemmPrecision::F32 && worst_l2 && N * Out >= 16) {
    const double tol = std::sqrt(double(In)) * kU;
    worst_l2->see(l2, tol, cname);
    EXPECT_LE(l2, tol) << cname << ": relative L2 error above the random-walk size sqrt(In) 2^-24";
  }
  return l2;
}

TEST(Linear, AllFormatsPathsPrecisionsStrides) {
  PrecisionGuard guard;
  Worst w64("linear_forward per-element, f64acc"), w32("linear_forward per-element, f32 (rigorous bound)");
  Worst worst_l2("linear_forward fp32 relative L2");
  Worst* worst[2] = {&w64, &w32};
  struct Shape {
    int64_t Out, In;
  };
  const Shape shapes[] = {{1, 32}, {37, 32}, {37, 96}, {64, 96}, {1, 96}, {5, 7}, {37, 7}};
  uint32_t seed = 1;
  int cases = 0;
  for (Fmt fmt : {Fmt::F32, Fmt::BF16, Fmt::F16, Fmt::MXFP4}) {
    for (const Shape& sh : shapes) {
      if (fmt == Fmt::MXFP4 && sh.In % 32 != 0) continue;
      const TestWeight W = make_weight(fmt, sh.Out, sh.In, 1000u + seed++);
      for (int64_t N : {1, 3, 4, 5, 17})
        for (GemmPrecision prec : {GemmPrecision::F64Accumulate, GemmPrecision::F32})
          for (bool acc : {false, true})
            for (bool padded : {false, true}) {
              const int64_t ldx = padded ? sh.In + 3 : sh.In, ldy = padded ? sh.Out + 2 : sh.Out;
              check_linear_case(W, N, ldx, ldy, acc, prec, seed++, worst, &worst_l2);
              ++cases;
            }
    }
  }
  std::printf("[info] %d linear_forward cases\n", cases);
}

// Out * In > 2^20 weight elements: the BLAS path widens the weight in several slabs (the last one short).
TEST(Linear, MultiSlabBlasPath) {
  PrecisionGuard guard;
  Worst w64("linear_forward multi-slab per-element, f64acc"), w32("linear_forward multi-slab per-element, f32");
  Worst worst_l2("linear_forward multi-slab fp32 relative L2");
  Worst* worst[2] = {&w64, &w32};
  const int64_t In = 32, Out = (int64_t(1) << 15) + 3;
  uint32_t seed = 77;
  for (Fmt fmt : {Fmt::F32, Fmt::BF16, Fmt::F16, Fmt::MXFP4}) {
    const TestWeight W = make_weight(fmt, Out, In, seed++);
    for (GemmPrecision prec : {GemmPrecision::F64Accumulate, GemmPrecision::F32})
      check_linear_case(W, 5, In + 1, Out + 1, true, prec, seed++, worst, &worst_l2);
  }
}

// In = 0: y = 0 (or untouched when accumulating), padding untouched.
TEST(Linear, ZeroInputFeatures) {
  PrecisionGuard guard;
  const float dummy = 0.0f;
  WeightRef W;
  W.format = Fmt::F32;
  W.rows = 3;
  W.cols = 0;
  W.data = &dummy;
  for (GemmPrecision prec : {GemmPrecision::F64Accumulate, GemmPrecision::F32})
    for (int64_t N : {1, 6})
      for (bool acc : {false, true}) {
        std::vector<float> y(size_t(N * 4), kSentinel);
        for (int64_t n = 0; n < N; ++n)
          for (int o = 0; o < 3; ++o) y[size_t(n * 4 + o)] = 1.5f;
        k3::set_gemm_precision(prec);
        k3::linear_forward(y.data(), 4, nullptr, 1, N, W, acc);
        for (int64_t n = 0; n < N; ++n) {
          for (int o = 0; o < 3; ++o)
            EXPECT_EQ(y[size_t(n * 4 + o)], acc ? 1.5f : 0.0f) << prec_name(prec) << " N=" << N << " acc=" << acc;
          EXPECT_TRUE(same_bits(y[size_t(n * 4 + 3)], kSentinel));
        }
      }
}

// row_slice + rows_to_f32 equal slicing the reference matrix (exactly: widening is exact for every format),
// and linear_forward over a slice equals the sliced reference (the MXFP4 slice must carry its scales).
TEST(Linear, RowSliceAndRowsToF32) {
  PrecisionGuard guard;
  k3::set_gemm_precision(GemmPrecision::F64Accumulate);
  Worst worst("linear_forward on row slices");
  const int64_t Out = 37, In = 64;
  uint32_t seed = 500;
  for (Fmt fmt : {Fmt::F32, Fmt::BF16, Fmt::F16, Fmt::MXFP4}) {
    const TestWeight W = make_weight(fmt, Out, In, seed++);
    const WeightRef full = W.view();
    // Whole-weight widening.
    {
      std::vector<float> dst(static_cast<size_t>(Out * In));
      full.rows_to_f32(dst.data(), 0, Out);
      for (int64_t i = 0; i < Out * In; ++i)
        ASSERT_EQ(double(dst[size_t(i)]), W.ref[size_t(i)]) << fmt_name(fmt) << " element " << i;
    }
    struct Sl {
      int64_t r0, n;
    };
    for (Sl sl : {Sl{0, 37}, Sl{1, 5}, Sl{36, 1}, Sl{13, 24}, Sl{20, 0}}) {
      const std::string cname =
          std::string(fmt_name(fmt)) + " slice r0=" + std::to_string(sl.r0) + " n=" + std::to_string(sl.n);
      const WeightRef s = full.row_slice(sl.r0, sl.n);
      EXPECT_EQ(s.rows, sl.n) << cname;
      EXPECT_EQ(s.cols, In) << cname;
      EXPECT_EQ(s.format, fmt) << cname;
      std::vector<float> a(size_t(std::max<int64_t>(sl.n, 1) * In), NAN), b(a.size(), NAN);
      s.rows_to_f32(a.data(), 0, sl.n);
      full.rows_to_f32(b.data(), sl.r0, sl.n);
      for (int64_t r = 0; r < sl.n; ++r)
        for (int64_t c = 0; c < In; ++c) {
          const double want = W.ref[size_t((sl.r0 + r) * In + c)];
          ASSERT_EQ(double(a[size_t(r * In + c)]), want) << cname << " slice.rows_to_f32 row " << r << " col " << c;
          ASSERT_EQ(double(b[size_t(r * In + c)]), want) << cname << " full.rows_to_f32(r0) row " << r << " col " << c;
        }
      // rows_to_f32 with an offset inside the slice.
      if (sl.n >= 3) {
        std::vector<float> d(static_cast<size_t>(2 * In));
        s.rows_to_f32(d.data(), 1, 2);
        for (int64_t i = 0; i < 2 * In; ++i)
          ASSERT_EQ(double(d[size_t(i)]), W.ref[size_t((sl.r0 + 1) * In + i)]) << cname << " offset 1, element " << i;
      }
      if (sl.n == 0) continue;
      // linear_forward on the slice (both paths) vs the sliced reference.
      TestWeight Ws;
      Ws.fmt = fmt;
      Ws.rows = sl.n;
      Ws.cols = In;
      Ws.ref.assign(W.ref.begin() + sl.r0 * In, W.ref.begin() + (sl.r0 + sl.n) * In);
      for (int64_t N : {1, 5}) {
        std::mt19937 rng(seed++);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> x(static_cast<size_t>(N * In));
        for (auto& v : x) v = nd(rng);
        std::vector<float> y(size_t(N * sl.n), NAN);
        k3::linear_forward(y.data(), x.data(), N, s);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t o = 0; o < sl.n; ++o) {
            double ref = 0.0, mag = 0.0;
            for (int64_t i = 0; i < In; ++i) {
              const double p = Ws.ref[size_t(o * In + i)] * double(x[size_t(n * In + i)]);
              ref += p;
              mag += std::fabs(p);
            }
            const double got = y[size_t(n * sl.n + o)];
            const double tol = kU * std::fabs(ref) + 2.0 * double(In + 2) * kUd * mag;
            const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
            auto at = [&] {
              return cname + " N=" + std::to_string(N) + " y[" + std::to_string(n) + "," + std::to_string(o) + "]";
            };
            worst.see(err, tol, at);
            EXPECT_LE(err, tol) << at() << " got " << got << " ref " << ref;
          }
      }
    }
  }
}

// linear_forward_f64 / linear_transposed_forward_f64: fp64 throughout, so only fp64 summation error:
// |got - ref| <= 2 (K+2) 2^-53 sum |w x| (K = length of the reduction; both sums counted).
TEST(Linear, F64ForwardAndTransposed) {
  Worst worst("linear_forward_f64"), worst_t("linear_transposed_forward_f64");
  struct Shape {
    int64_t Out, In;
  };
  const Shape shapes[] = {{1, 32}, {37, 96}, {5, 7}, {(int64_t(1) << 15) + 3, 32}};  // the last: several slabs
  uint32_t seed = 900;
  for (Fmt fmt : {Fmt::F32, Fmt::BF16, Fmt::F16, Fmt::MXFP4})
    for (const Shape& sh : shapes) {
      if (fmt == Fmt::MXFP4 && sh.In % 32 != 0) continue;
      const TestWeight W = make_weight(fmt, sh.Out, sh.In, seed++);
      const bool big = sh.Out > 1000;
      for (int64_t N : big ? std::vector<int64_t>{3} : std::vector<int64_t>{1, 3, 17}) {
        std::ostringstream cs;
        cs << fmt_name(fmt) << " N=" << N << " Out=" << sh.Out << " In=" << sh.In;
        std::mt19937 rng(seed++);
        std::normal_distribution<double> nd(0.0, 1.0);
        // Forward: x [N, In] -> y [N, Out].
        {
          std::vector<double> x(static_cast<size_t>(N * sh.In)), y(size_t(N * sh.Out), NAN);
          for (auto& v : x) v = nd(rng);
          k3::linear_forward_f64(y.data(), x.data(), N, W.view());
          int bad = 0;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t o = 0; o < sh.Out; ++o) {
              double ref = 0.0, mag = 0.0;
              for (int64_t i = 0; i < sh.In; ++i) {
                const double p = W.ref[size_t(o * sh.In + i)] * x[size_t(n * sh.In + i)];
                ref += p;
                mag += std::fabs(p);
              }
              const double got = y[size_t(n * sh.Out + o)];
              const double tol = 2.0 * double(sh.In + 2) * kUd * mag;
              const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
              worst.see(err, tol, cs.str());
              if (!(err <= tol) && bad++ == 0)
                ADD_FAILURE() << cs.str() << " forward y[" << n << "," << o << "] got " << got << " ref " << ref;
            }
        }
        // Transposed: x [N, Out] -> y [N, In] = x W.
        {
          std::vector<double> x(static_cast<size_t>(N * sh.Out)), y(size_t(N * sh.In), NAN);
          for (auto& v : x) v = nd(rng);
          k3::linear_transposed_forward_f64(y.data(), x.data(), N, W.view());
          int bad = 0;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t i = 0; i < sh.In; ++i) {
              double ref = 0.0, mag = 0.0;
              for (int64_t o = 0; o < sh.Out; ++o) {
                const double p = x[size_t(n * sh.Out + o)] * W.ref[size_t(o * sh.In + i)];
                ref += p;
                mag += std::fabs(p);
              }
              const double got = y[size_t(n * sh.In + i)];
              const double tol = 2.0 * double(sh.Out + 2) * kUd * mag;
              const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
              worst_t.see(err, tol, cs.str());
              if (!(err <= tol) && bad++ == 0)
                ADD_FAILURE() << cs.str() << " transposed y[" << n << "," << i << "] got " << got << " ref " << ref;
            }
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------------------
// 2. MXFP4

// A 64-element row: group 0 holds nibble k % 16 at element k (so every nibble appears at an even and an
// odd position), group 1 the same pattern reversed. Bytes: element 2j in the low nibble of byte j.
std::vector<uint8_t> nibble_table_row() {
  std::vector<uint8_t> p(32);
  for (int j = 0; j < 16; ++j) p[size_t(j)] = uint8_t(((2 * j) % 16) | (((2 * j + 1) % 16) << 4));
  for (int j = 0; j < 16; ++j) p[size_t(16 + j)] = uint8_t((15 - (2 * j) % 16) | ((15 - (2 * j + 1) % 16) << 4));
  return p;
}

TEST(Mxfp4, DecodesKnownBytes) {
  const float table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int k = 0; k < 16; ++k) {
    EXPECT_TRUE(same_bits(k3::kE2M1[k], table[k])) << "kE2M1[" << k << "]";
  }
  EXPECT_EQ(k3::e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(k3::e8m0_to_f32(128), 2.0f);
  EXPECT_EQ(k3::e8m0_to_f32(120), 0x1p-7f);
  EXPECT_EQ(k3::e8m0_to_f32(0), 0x1p-127f);
  EXPECT_EQ(k3::e8m0_to_f32(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(k3::e8m0_to_f32(255)));

  const std::vector<uint8_t> packed = nibble_table_row();
  struct ScaleCase {
    uint8_t s0, s1;
  };
  for (ScaleCase sc : {ScaleCase{127, 127}, ScaleCase{128, 120}, ScaleCase{120, 128}, ScaleCase{127, 255},
                       ScaleCase{255, 127}, ScaleCase{0, 254}}) {
    const uint8_t scales[2] = {sc.s0, sc.s1};
    float dec[64];
    k3::mxfp4_decode_row(dec, packed.data(), scales, 64);
    // The same bytes through WeightRef (two identical rows, to also cover rows_to_f32's row offsets).
    std::vector<uint8_t> p2(packed);
    p2.insert(p2.end(), packed.begin(), packed.end());
    const uint8_t s2[4] = {sc.s0, sc.s1, sc.s0, sc.s1};
    WeightRef w;
    w.format = Fmt::MXFP4;
    w.rows = 2;
    w.cols = 64;
    w.data = p2.data();
    w.scales = s2;
    float dec2[64];
    w.rows_to_f32(dec2, 1, 1);
    for (int c = 0; c < 64; ++c) {
      const int nib = c < 32 ? c % 16 : 15 - (c - 32) % 16;
      const uint8_t s = c < 32 ? sc.s0 : sc.s1;
      const std::string at = "scales {" + std::to_string(sc.s0) + "," + std::to_string(sc.s1) + "} element " +
                             std::to_string(c) + " nibble " + std::to_string(nib);
      for (const float got : {dec[c], dec2[c]}) {
        if (s == 255) {
          EXPECT_TRUE(std::isnan(got)) << at;
        } else {
          const float want = float(ref_e2m1(nib) * std::ldexp(1.0, int(s) - 127));
          EXPECT_EQ(got, want) << at;
          if (nib == 8) {
            EXPECT_TRUE(std::signbit(got)) << at << ": nibble 8 is -0";
          }
          if (nib == 0) {
            EXPECT_FALSE(std::signbit(got)) << at;
          }
        }
      }
    }
  }
  // Nibble order inside one byte: 0x71 -> element 0 = E2M1[1] = 0.5 (low), element 1 = E2M1[7] = 6 (high).
  std::vector<uint8_t> one(16, 0);
  one[0] = 0x71;
  const uint8_t s127 = 127;
  float d[32];
  k3::mxfp4_decode_row(d, one.data(), &s127, 32);
  EXPECT_EQ(d[0], 0.5f);
  EXPECT_EQ(d[1], 6.0f);
  for (int c = 2; c < 32; ++c) EXPECT_EQ(d[c], 0.0f) << c;
}

// Rows whose values are all representable (any scale, any nibbles): encode then decode gives them back;
// when a group's largest magnitude is 4 or 6 (times its scale), the encoder must also reproduce the bytes.
TEST(Mxfp4, EncodeDecodeRepresentableRows) {
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> nibd(0, 15), expd(-20, 20), top(0, 1);
  const int64_t cols = 128;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint8_t> packed(cols / 2), scales(cols / 32);
    std::vector<int> nibs(cols);
    for (int64_t g = 0; g < cols / 32; ++g) {
      scales[size_t(g)] = uint8_t(127 + expd(rng));
      for (int i = 0; i < 32; ++i) nibs[size_t(g * 32 + i)] = nibd(rng);
      // Half the groups: force a maximal element (|nibble| 6 or 7) so the scale is determined.
      if (trial % 2 == 0) nibs[size_t(g * 32 + (trial + g) % 32)] = (top(rng) ? 8 : 0) | (top(rng) ? 7 : 6);
    }
    // Some groups all zero.
    if (trial % 7 == 3)
      for (int i = 0; i < 32; ++i) nibs[size_t(32 + i)] = (i % 2) ? 8 : 0;
    for (int64_t j = 0; j < cols / 2; ++j)
      packed[size_t(j)] = uint8_t(nibs[size_t(2 * j)] | (nibs[size_t(2 * j + 1)] << 4));
    std::vector<float> row(cols);
    for (int64_t c = 0; c < cols; ++c) row[size_t(c)] = float(ref_mxfp4(packed.data(), scales.data(), c));

    std::vector<uint8_t> p2(cols / 2), s2(cols / 32);
    k3::mxfp4_encode_row(p2.data(), s2.data(), row.data(), cols);
    std::vector<float> dec(cols);
    k3::mxfp4_decode_row(dec.data(), p2.data(), s2.data(), cols);
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(dec[size_t(c)], row[size_t(c)]) << "trial " << trial << " element " << c;
    if (trial % 2 == 0) {
      for (int64_t g = 0; g < cols / 32; ++g) {
        if (trial % 7 == 3 && g == 1) continue;
        ASSERT_EQ(int(s2[size_t(g)]), int(scales[size_t(g)])) << "trial " << trial << " group " << g;
        for (int j = 0; j < 16; ++j) {
          // -0 encodes as +0 (both decode to zero): compare bytes with sign-of-zero normalised.
          auto norm = [](int nib) { return nib == 8 ? 0 : nib; };
          const uint8_t a = p2[size_t(g * 16 + j)], b = packed[size_t(g * 16 + j)];
          ASSERT_EQ(norm(a & 0xf), norm(b & 0xf)) << "trial " << trial << " group " << g << " byte " << j;
          ASSERT_EQ(norm(a >> 4), norm(b >> 4)) << "trial " << trial << " group " << g << " byte " << j;
        }
      }
    }
  }
}

// Random rows: each group's scale is the OCP choice 2^(floor(log2 max|x|) - 2) (max maps into [4, 8)), and
// every decoded value is the nearest point of the scaled E2M1 grid: |x - dec| <= half the local spacing for
// |x|/s <= 6, and dec = +-6 s above (saturation).
TEST(Mxfp4, EncodeRandomRowsIsNearest) {
  Worst worst("mxfp4 encode |x-dec| / half spacing");
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> shift(-30, 30);
  const int64_t cols = 256;
  const double grid[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<float> row(cols);
    for (int64_t g = 0; g < cols / 32; ++g) {
      const int sh = shift(rng);
      for (int i = 0; i < 32; ++i) row[size_t(g * 32 + i)] = std::ldexp(nd(rng), sh);
    }
    std::vector<uint8_t> packed(cols / 2), scales(cols / 32);
    k3::mxfp4_encode_row(packed.data(), scales.data(), row.data(), cols);
    for (int64_t g = 0; g < cols / 32; ++g) {
      double mx = 0;
      for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(double(row[size_t(g * 32 + i)])));
      int e2;
      std::frexp(mx, &e2);  // mx in [2^(e2-1), 2^e2)
      const int want_e = (e2 - 1) - 2;
      ASSERT_EQ(int(scales[size_t(g)]) - 127, want_e) << "trial " << trial << " group " << g << " max " << mx;
      const double s = std::ldexp(1.0, int(scales[size_t(g)]) - 127);
      for (int i = 0; i < 32; ++i) {
        const int64_t c = g * 32 + i;
        const double x = row[size_t(c)], dec = ref_mxfp4(packed.data(), scales.data(), c);
        const double v = std::fabs(x) / s;
        const std::string at = "trial " + std::to_string(trial) + " element " + std::to_string(c);
        // Nearest on the grid (brute force over all 15 distinct values).
        double best = INFINITY;
        for (double gv : grid)
          for (double sg : {1.0, -1.0}) best = std::min(best, std::fabs(x - sg * gv * s));
        ASSERT_EQ(std::fabs(x - dec), best) << at << ": x " << x << " dec " << dec;
        ASSERT_TRUE(dec == 0 || std::signbit(dec) == std::signbit(x)) << at;
        if (v <= 6.0) {
          int k = 0;
          while (k < 7 && grid[k + 1] < v) ++k;
          const double half = (grid[std::min(k + 1, 7)] - grid[k]) / 2 * s;
          worst.see(std::fabs(x - dec), half, at);
          ASSERT_LE(std::fabs(x - dec), half) << at;
        } else {
          ASSERT_EQ(std::fabs(dec), 6.0 * s) << at << ": saturates at 6 s";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// 3. Router

struct RefRoute {
  std::vector<int> idx;
  std::vector<double> w, s;
  std::vector<bool> group_ok;       // per group: may supply experts
  double min_sel_gap = INFINITY;    // smallest gap in (score + bias) among the K+1 best allowed experts
                                    // (pairs with identical inputs excluded)
  double min_group_gap = INFINITY;  // gap between the last kept and the first dropped group score
};

// One row, in double: sigmoid, selection by score + bias with ties to the lower index, group limit by the
// sum of each group's two best biased scores, weights from the unbiased scores.
RefRoute ref_router(const float* logits, const float* bias, const k3::moe::RouterParams& p) {
  const int64_t E = p.num_experts, K = p.top_k, G = p.num_groups, per = E / G;
  RefRoute r;
  r.s.resize(size_t(E));
  std::vector<double> sel(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    r.s[size_t(e)] = 1.0 / (1.0 + std::exp(-double(logits[e])));
    sel[size_t(e)] = r.s[size_t(e)] + (bias ? double(bias[e]) : 0.0);
  }
  r.group_ok.assign(size_t(G), true);
  if (G > 1 && p.topk_groups < G) {
    std::vector<double> gs(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs[size_t(g)] = per >= 2 ? v[0] + v[1] : v[0];
    }
    std::vector<int> go(static_cast<size_t>(G));
    std::iota(go.begin(), go.end(), 0);
    std::stable_sort(go.begin(), go.end(), [&](int a, int b) { return gs[size_t(a)] > gs[size_t(b)]; });
    for (int64_t k = p.topk_groups; k < G; ++k) r.group_ok[size_t(go[size_t(k)])] = false;
    r.min_group_gap = gs[size_t(go[size_t(p.topk_groups - 1)])] - gs[size_t(go[size_t(p.topk_groups)])];
  }
  std::vector<int> cand;
  for (int64_t e = 0; e < E; ++e)
    if (r.group_ok[size_t(e / per)]) cand.push_back(int(e));
  std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return sel[size_t(a)] > sel[size_t(b)]; });
  // Neighbours with bit-identical logit and bias tie exactly in any arithmetic (the kernel's too) and are
  // ordered by index on both sides; only distinct inputs need a safe gap.
  for (int64_t k = 0; k + 1 < std::min<int64_t>(K + 1, int64_t(cand.size())); ++k) {
    const int a = cand[size_t(k)], b = cand[size_t(k + 1)];
    if (logits[a] == logits[b] && (!bias || bias[a] == bias[b])) continue;
    r.min_sel_gap = std::min(r.min_sel_gap, sel[size_t(a)] - sel[size_t(b)]);
  }
  double sum = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    r.idx.push_back(cand[size_t(k)]);
    sum += r.s[size_t(cand[size_t(k)])];
  }
  for (int64_t k = 0; k < K; ++k) {
    const double s = r.s[size_t(r.idx[size_t(k)])];
    r.w.push_back((p.renormalize ? s / sum : s) * double(p.scaling));
  }
  return r;
}

// Tolerances, from the kernel's fp32 sigmoid (exp within 1 ulp, then one add and one divide): a score is
// within 4 * 2^-24 relative of the true sigmoid; a weight s_j / sum s (fp64 division) carries the error of
// s_j and of the sum, plus the final rounding: 9 * 2^-24 relative. The scores of two experts can therefore
// be misordered only when their biased scores are closer than ~1e-6, so random data is asserted to keep its
// selection gaps above that (a precondition on the data, not a tolerance).
constexpr double kScoreTol = 4 * kU, kWeightTol = 9 * kU, kMinGap = 1e-6;

void check_router(const std::vector<float>& logits, const std::vector<float>* bias, int64_t N,
                  const k3::moe::RouterParams& p, const std::string& cname, Worst& ws, Worst& ww,
                  bool require_gaps = true) {
  const int64_t E = p.num_experts, K = p.top_k;
  std::vector<int32_t> idx(size_t(N * K), -1);
  std::vector<float> w(size_t(N * K), NAN), sc(size_t(N * E), NAN);
  k3::moe::router_forward(idx.data(), w.data(), sc.data(), logits.data(), bias ? bias->data() : nullptr, N, p);
  for (int64_t n = 0; n < N; ++n) {
    const RefRoute r = ref_router(&logits[size_t(n * E)], bias ? bias->data() : nullptr, p);
    auto at = [&] { return cname + " row " + std::to_string(n); };
    if (require_gaps) {
      ASSERT_GT(r.min_sel_gap, kMinGap) << at() << ": test data has a near-tie; change the seed";
      ASSERT_GT(r.min_group_gap, 2 * kMinGap) << at() << ": test data has a near-tie between groups";
    }
    for (int64_t e = 0; e < E; ++e) {
      const double err = std::fabs(sc[size_t(n * E + e)] - r.s[size_t(e)]), tol = kScoreTol * r.s[size_t(e)];
      ws.see(err, tol, at);
      ASSERT_LE(err, tol) << at() << " scores_out[" << e << "]";
    }
    for (int64_t k = 0; k < K; ++k) {
      ASSERT_EQ(idx[size_t(n * K + k)], r.idx[size_t(k)]) << at() << " slot " << k;
      ASSERT_TRUE(r.group_ok[size_t(idx[size_t(n * K + k)] / (E / p.num_groups))]) << at() << " slot " << k;
      const double err = std::fabs(w[size_t(n * K + k)] - r.w[size_t(k)]), tol = kWeightTol * std::fabs(r.w[size_t(k)]);
      ww.see(err, tol, at);
      ASSERT_LE(err, tol) << at() << " weight slot " << k << " got " << w[size_t(n * K + k)] << " ref "
                          << r.w[size_t(k)];
    }
  }
}

TEST(Router, MatchesReferenceRandom) {
  Worst ws("router scores_out"), ww("router weights");
  struct Cfg {
    int64_t E, K, G, TG;
    bool renorm, use_bias;
  };
  const Cfg cfgs[] = {
      {64, 8, 1, 1, true, true},  {64, 8, 1, 1, false, true},  {64, 8, 1, 1, true, false},
      {64, 6, 8, 3, true, true},  {16, 4, 4, 2, true, true},   {16, 4, 4, 2, false, true},
      {16, 16, 1, 1, true, true}, {16, 16, 1, 1, false, true}, {32, 4, 4, 4, true, true},  // TG == G: no limit
      {8, 1, 1, 1, true, true},
  };
  uint32_t seed = 11;
  for (const Cfg& c : cfgs) {
    const int64_t N = 33;
    std::mt19937 rng(seed++);
    std::vector<float> logits = normal_vec(rng, size_t(N * c.E), 2.0f);
    std::vector<float> bias = normal_vec(rng, size_t(c.E), 0.1f);
    k3::moe::RouterParams p;
    p.num_experts = c.E;
    p.top_k = c.K;
    p.num_groups = c.G;
    p.topk_groups = c.TG;
    p.renormalize = c.renorm;
    p.scaling = 2.5f;
    // The data precondition of check_router (no near-ties at the selection boundary) is met by
    // redrawing offending rows: the draws differ between builds (FMA contraction in the library's
    // normal distribution), so a fixed seed alone cannot guarantee it everywhere.
    for (int64_t n = 0; n < N; ++n)
      for (int attempt = 0;; ++attempt) {
        const RefRoute r = ref_router(&logits[size_t(n * c.E)], c.use_bias ? bias.data() : nullptr, p);
        if (r.min_sel_gap > kMinGap && r.min_group_gap > 2 * kMinGap) break;
        ASSERT_LT(attempt, 100) << "could not draw tie-free router data";
        const std::vector<float> row = normal_vec(rng, size_t(c.E), 2.0f);
        std::copy(row.begin(), row.end(), logits.begin() + n * c.E);
      }
    std::ostringstream cs;
    cs << "E=" << c.E << " K=" << c.K << " G=" << c.G << " TG=" << c.TG << " renorm=" << c.renorm
       << " bias=" << c.use_bias;
    check_router(logits, c.use_bias ? &bias : nullptr, N, p, cs.str(), ws, ww);
    if (HasFatalFailure()) return;
  }
}

TEST(Router, BiasSteersSelectionNotWeights) {
  // Expert 3 has the lowest score but a large bias: it is selected (first), and its weight is its unbiased
  // score over the sum of the unbiased scores.
  const int64_t E = 8;
  const std::vector<float> logits = {2.0f, 1.5f, 1.0f, -3.0f, 0.5f, 0.0f, -0.5f, -1.0f};
  std::vector<float> bias(E, 0.0f);
  bias[3] = 1.0f;
  k3::moe::RouterParams p;
  p.num_experts = E;
  p.top_k = 3;
  p.scaling = 2.5f;
  int32_t idx[3], idx0[3];
  float w[3], w0[3];
  k3::moe::router_forward(idx, w, nullptr, logits.data(), bias.data(), 1, p);
  k3::moe::router_forward(idx0, w0, nullptr, logits.data(), nullptr, 1, p);
  EXPECT_EQ(std::vector<int>(idx, idx + 3), (std::vector<int>{3, 0, 1}));
  EXPECT_EQ(std::vector<int>(idx0, idx0 + 3), (std::vector<int>{0, 1, 2}));
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  const double sum = sig(-3.0) + sig(2.0) + sig(1.5);
  const double want[3] = {2.5 * sig(-3.0) / sum, 2.5 * sig(2.0) / sum, 2.5 * sig(1.5) / sum};
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(w[k], want[k], kWeightTol * want[k]) << "slot " << k;
  // Through the general checker too (well separated).
  Worst ws("router bias case scores"), ww("router bias case weights");
  check_router(logits, &bias, 1, p, "bias steers", ws, ww);
}

TEST(Router, TiesResolveToLowerIndex) {
  Worst ws("router tie scores"), ww("router tie weights");
  k3::moe::RouterParams p;
  p.scaling = 2.5f;
  // (a) All logits equal, no bias: the K lowest indices, in order; equal weights scaling / K.
  {
    p.num_experts = 12;
    p.top_k = 5;
    const std::vector<float> logits(12, 0.3f);
    int32_t idx[5];
    float w[5];
    k3::moe::router_forward(idx, w, nullptr, logits.data(), nullptr, 1, p);
    for (int k = 0; k < 5; ++k) {
      EXPECT_EQ(idx[k], k) << "all-equal, slot " << k;
      EXPECT_NEAR(w[k], 2.5 / 5, kWeightTol * 0.5) << "all-equal, slot " << k;
    }
    check_router(logits, nullptr, 1, p, "all equal", ws, ww, /*require_gaps=*/false);
  }
  // (b) A tie at the selection boundary: expert 6 best, experts 1, 4, 7 equal for the last two slots.
  {
    p.num_experts = 8;
    p.top_k = 3;
    const std::vector<float> logits = {-1.0f, 0.25f, -2.0f, -1.5f, 0.25f, -0.5f, 3.0f, 0.25f};
    int32_t idx[3];
    float w[3];
    k3::moe::router_forward(idx, w, nullptr, logits.data(), nullptr, 1, p);
    EXPECT_EQ(std::vector<int>(idx, idx + 3), (std::vector<int>{6, 1, 4}));
  }
  // (c) Equal score + bias from different unbiased scores. sA, sB in (0.5, 1) are within a factor 2, so
  // d = sB - sA is exact in fp32 (Sterbenz) and sA + d == sB exactly: an exact tie in the kernel's own
  // fp32 arithmetic. The lower index wins whichever of the two carries the bias, and its weight is its
  // own unbiased score.
  for (int variant = 0; variant < 2; ++variant) {
    p.num_experts = 8;
    p.top_k = 1;
    p.renormalize = false;
    std::vector<float> logits(8, -2.0f);
    const int lo = 2, hi = 5;
    const int biased = variant == 0 ? lo : hi, plain = variant == 0 ? hi : lo;
    logits[size_t(biased)] = 0.3f;
    logits[size_t(plain)] = 1.2f;
    const float sA = k3::sigmoidf_stable(0.3f), sB = k3::sigmoidf_stable(1.2f);
    std::vector<float> bias(8, 0.0f);
    bias[size_t(biased)] = sB - sA;
    ASSERT_EQ(sA + bias[size_t(biased)], sB) << "construction: the tie must be exact in fp32";
    int32_t idx[1];
    float w[1];
    k3::moe::router_forward(idx, w, nullptr, logits.data(), bias.data(), 1, p);
    EXPECT_EQ(idx[0], lo) << "variant " << variant;
    const double s_lo = 1.0 / (1.0 + std::exp(-double(logits[size_t(lo)])));
    EXPECT_NEAR(w[0], 2.5 * s_lo, kWeightTol * 2.5 * s_lo) << "variant " << variant << ": unbiased weight";
    p.renormalize = true;
  }
}

TEST(Router, NanScoresSelectLastAndNeverBreakTheSelection) {
  // NaN logits (a NaN input or router weight) must still give K distinct experts in range: the NaN
  // ones after every number, in index order, with NaN weights so that the forward's checks see them.
  k3::moe::RouterParams p;
  p.num_experts = 8;
  p.top_k = 4;
  std::vector<float> logits = {0.1f, NAN, -1.0f, NAN, 2.0f, NAN, NAN, NAN};
  int32_t idx[4];
  float w[4];
  k3::moe::router_forward(idx, w, nullptr, logits.data(), nullptr, 1, p);
  EXPECT_EQ(std::vector<int>(idx, idx + 4), (std::vector<int>{4, 0, 2, 1}));
  EXPECT_TRUE(std::isnan(w[0])) << "renormalised over a NaN score";
  std::fill(logits.begin(), logits.end(), NAN);
  p.num_groups = 4;
  p.topk_groups = 2;
  k3::moe::router_forward(idx, w, nullptr, logits.data(), nullptr, 1, p);
  std::vector<int> got(idx, idx + 4);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end()) << "distinct experts";
  for (int e : got) EXPECT_TRUE(e >= 0 && e < 8) << e;
}

TEST(Router, GroupLimitedSelection) {
  // E = 16 in 4 groups of 4, topk_groups = 2, K = 4. Group 0 holds the single best expert (0) but its sum
  // of top-2 (0.9933 + 0.0067 = 1.0) loses to groups 1 (2 x 0.731) and 2 (2 x 0.622): expert 0 must not be
  // selected although a plain top-4 would take it first.
  const int64_t E = 16;
  std::vector<float> logits(E, -2.0f);
  logits[0] = 5.0f;
  logits[1] = logits[2] = logits[3] = -5.0f;
  logits[4] = logits[6] = 1.0f;
  logits[9] = logits[11] = 0.5f;
  for (int e = 12; e < 16; ++e) logits[size_t(e)] = -1.0f;
  k3::moe::RouterParams p;
  p.num_experts = E;
  p.top_k = 4;
  p.num_groups = 4;
  p.topk_groups = 2;
  p.scaling = 2.5f;
  int32_t idx[4];
  float w[4];
  k3::moe::router_forward(idx, w, nullptr, logits.data(), nullptr, 1, p);
  EXPECT_EQ(std::vector<int>(idx, idx + 4), (std::vector<int>{4, 6, 9, 11}));
  p.num_groups = 1;
  p.topk_groups = 1;
  k3::moe::router_forward(idx, w, nullptr, logits.data(), nullptr, 1, p);
  EXPECT_EQ(idx[0], 0) << "without the group limit expert 0 comes first";
  // The group score uses the biased scores: lifting group 3's two experts by bias 0.5 puts group 3 in.
  p.num_groups = 4;
  p.topk_groups = 2;
  std::vector<float> bias(E, 0.0f);
  bias[13] = bias[14] = 0.5f;
  k3::moe::router_forward(idx, w, nullptr, logits.data(), bias.data(), 1, p);
  EXPECT_EQ(std::vector<int>(idx, idx + 4), (std::vector<int>{13, 14, 4, 6}));
  Worst ws("router group scores"), ww("router group weights");
  check_router(logits, &bias, 1, p, "group crafted", ws, ww, /*require_gaps=*/false);
}

// ---------------------------------------------------------------------------------------------------------
// 4. AttnRes

// Double reference of K3-ARCHITECTURE.md §5.2 for one token row. Returns out and sum_i a_i |V_i| (the scale
// of the cancellation-free error), and optionally uses key scores from other sources (the property test).
void ref_attnres(std::vector<double>& out, std::vector<double>& mag, const std::vector<const float*>& src,
                 const std::vector<const float*>& key_src, int64_t D, const float* q, double eps) {
  const size_t S = src.size();
  std::vector<double> s(S);
  double mx = -INFINITY;
  for (size_t i = 0; i < S; ++i) {
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += double(key_src[i][d]) * key_src[i][d];
    const double rinv = 1.0 / std::sqrt(ss / double(D) + eps);
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) dot += (double(key_src[i][d]) * rinv) * double(q[d]);
    s[i] = dot;
    mx = std::max(mx, dot);
  }
  double z = 0.0;
  for (auto& v : s) z += (v = std::exp(v - mx));
  out.assign(size_t(D), 0.0);
  mag.assign(size_t(D), 0.0);
  for (size_t i = 0; i < S; ++i)
    for (int64_t d = 0; d < D; ++d) {
      out[size_t(d)] += s[i] / z * double(src[i][d]);
      mag[size_t(d)] += s[i] / z * std::fabs(double(src[i][d]));
    }
}

// The kernel keeps fp64 internally and rounds once: |got - ref| <= 2^-24 |ref| + 1e-12 sum a_i |V_i|
// (the second term bounds the fp64 work, ~D * S * |score| * 2^-53 << 1e-12).
constexpr double kAttnResInner = 1e-12;

struct AttnCase {
  int S;
  int64_t N, D;
  std::vector<std::vector<float>> src;
  std::vector<float> q;
};
AttnCase make_attn_case(int S, int64_t N, int64_t D, uint32_t seed, float qsd) {
  std::mt19937 rng(seed);
  AttnCase c{S, N, D, {}, normal_vec(rng, size_t(D), qsd)};
  for (int i = 0; i < S; ++i) {
    c.src.push_back(normal_vec(rng, size_t(N * D), std::ldexp(1.0f, i % 5 - 2)));  // magnitudes 1/4 .. 4
    for (auto& v : c.src.back()) v += 0.5f;  // a common mean, so the sources are not orthogonal-ish noise
  }
  return c;
}

void check_attnres(const AttnCase& c, const std::vector<std::vector<float>>& key_src, float eps, double extra_tol_rel,
                   const std::string& cname, Worst& worst) {
  std::vector<const float*> ptrs;
  for (const auto& s : c.src) ptrs.push_back(s.data());
  std::vector<float> out(size_t(c.N * c.D), NAN);
  k3::attnres_forward(out.data(), ptrs.data(), c.S, c.N, c.D, c.q.data(), eps);
  std::vector<double> ref, mag;
  for (int64_t n = 0; n < c.N; ++n) {
    std::vector<const float*> rs, ks;
    for (int i = 0; i < c.S; ++i) {
      rs.push_back(c.src[size_t(i)].data() + n * c.D);
      ks.push_back(key_src[size_t(i)].data() + n * c.D);
    }
    ref_attnres(ref, mag, rs, ks, c.D, c.q.data(), eps);
    for (int64_t d = 0; d < c.D; ++d) {
      const double got = out[size_t(n * c.D + d)];
      const double tol = kU * std::fabs(ref[size_t(d)]) + (kAttnResInner + extra_tol_rel) * mag[size_t(d)];
      const double err = std::isfinite(got) ? std::fabs(got - ref[size_t(d)]) : INFINITY;
      auto at = [&] { return cname + " out[" + std::to_string(n) + "," + std::to_string(d) + "]"; };
      worst.see(err, tol, at);
      ASSERT_LE(err, tol) << at() << " got " << got << " ref " << ref[size_t(d)];
    }
  }
}

TEST(AttnRes, MatchesReference) {
  Worst worst("attnres vs reference");
  uint32_t seed = 40;
  for (int S : {1, 2, 9})
    for (int64_t D : {64, 37})
      for (float qsd : {0.3f, 1.0f}) {
        const AttnCase c = make_attn_case(S, 5, D, seed++, qsd);
        std::ostringstream cs;
        cs << "S=" << S << " D=" << D << " qsd=" << qsd;
        check_attnres(c, c.src, 1e-5f, 0.0, cs.str(), worst);
        if (HasFatalFailure()) return;
      }
}

TEST(AttnRes, SingleSourceIsExactAndZeroQueryIsMean) {
  Worst worst("attnres zero query");
  for (int64_t D : {64, 37}) {
    AttnCase c = make_attn_case(1, 4, D, 123, 1.0f);
    std::vector<float> out(static_cast<size_t>(c.N * D));
    const float* p = c.src[0].data();
    k3::attnres_forward(out.data(), &p, 1, c.N, D, c.q.data(), 1e-5f);
    for (int64_t i = 0; i < c.N * D; ++i)
      ASSERT_TRUE(same_bits(out[size_t(i)], c.src[0][size_t(i)])) << "S=1 D=" << D << " i=" << i;
  }
  for (int S : {2, 9}) {
    AttnCase c = make_attn_case(S, 4, 64, 321 + S, 1.0f);
    std::fill(c.q.begin(), c.q.end(), 0.0f);
    std::vector<const float*> ptrs;
    for (const auto& s : c.src) ptrs.push_back(s.data());
    std::vector<float> out(static_cast<size_t>(c.N * c.D));
    k3::attnres_forward(out.data(), ptrs.data(), S, c.N, c.D, c.q.data(), 1e-5f);
    for (int64_t i = 0; i < c.N * c.D; ++i) {
      double mean = 0.0, mag = 0.0;
      for (int k = 0; k < S; ++k) {
        mean += c.src[size_t(k)][size_t(i)];
        mag += std::fabs(c.src[size_t(k)][size_t(i)]);
      }
      mean /= S;
      mag /= S;
      const double err = std::fabs(out[size_t(i)] - mean), tol = kU * std::fabs(mean) + kAttnResInner * mag;
      worst.see(err, tol, "S=" + std::to_string(S));
      ASSERT_LE(err, tol) << "S=" << S << " i=" << i;
    }
  }
}

// The key is RMS-normalised, so scaling a source scales its contribution to the output but leaves its score
// alone: the output equals the reference with scores from the UNSCALED sources mixing the SCALED raw ones.
// With eps = 0 and a power-of-two factor (1024) this is exact arithmetic for the kernel too; with 1000 the
// scaled source is rounded once per element (2^-24), which moves a score by at most 2 * 2^-24 sum_d |K_d q_d|
// and the softmax weights by twice that, hence the extra term. (With eps = 1e-5 the score would move by
// ~eps / (2 mean V^2) relative, not 'not at all'.)
TEST(AttnRes, ScalingASourceKeepsItsScore) {
  Worst worst("attnres scale invariance");
  uint32_t seed = 600;
  for (int S : {2, 9})
    for (float factor : {1024.0f, 1000.0f})
      for (int which : {0, S - 1}) {
        AttnCase c = make_attn_case(S, 4, 64, seed++, 1.0f);
        const std::vector<std::vector<float>> unscaled = c.src;
        for (auto& v : c.src[size_t(which)]) v *= factor;
        double extra = 0.0;
        if (factor != 1024.0f) {
          double maxkq = 0.0;  // max over rows and sources of sum_d |K_d q_d| (K: RMS-normalised source)
          for (int i = 0; i < S; ++i)
            for (int64_t n = 0; n < c.N; ++n) {
              double ss = 0.0, kq = 0.0;
              for (int64_t d = 0; d < c.D; ++d)
                ss += double(unscaled[size_t(i)][size_t(n * c.D + d)]) * unscaled[size_t(i)][size_t(n * c.D + d)];
              for (int64_t d = 0; d < c.D; ++d)
                kq += std::fabs(unscaled[size_t(i)][size_t(n * c.D + d)] * c.q[size_t(d)]);
              maxkq = std::max(maxkq, kq / std::sqrt(ss / double(c.D)));
            }
          extra = 4.0 * kU * maxkq * (1.0 + 1e-6);
        }
        std::ostringstream cs;
        cs << "S=" << S << " factor=" << factor << " source " << which;
        check_attnres(c, unscaled, 0.0f, extra, cs.str(), worst);
        if (HasFatalFailure()) return;
      }
}

// ---------------------------------------------------------------------------------------------------------
// 5. RMSNorm and GLU

// y = w x / sqrt(mean x^2 + eps): the kernel rounds r = 1/sqrt(...) to fp32, then x*r, then w*(x*r): three
// fp32 roundings, so |got - ref| <= 3 * 2^-24 |ref| (two without a weight), up to second-order terms.
TEST(RmsNorm, MatchesReference) {
  Worst worst("rmsnorm");
  uint32_t seed = 70;
  for (int64_t D : {1, 37, 64, 2048})
    for (bool padded : {false, true})
      for (bool with_weight : {true, false})
        for (bool in_place : {false, true})
          for (float eps : {1e-5f, 1e-6f}) {
            const int64_t N = 5, ld = padded ? D + 3 : D;
            std::mt19937 rng(seed++);
            std::vector<float> x(size_t(N * ld), in_place ? kSentinel : NAN);
            for (int64_t n = 0; n < N; ++n)
              for (int64_t d = 0; d < D; ++d) {
                float v = normal_vec(rng, 1)[0];
                if (n == 1) v = 0.0f;     // all-zero row: y = 0
                if (n == 2) v *= 1e20f;   // large row: the sum of squares must not overflow
                if (n == 3) v *= 1e-20f;  // tiny row: eps dominates
                x[size_t(n * ld + d)] = v;
              }
            const std::vector<float> w = normal_vec(rng, size_t(D));
            std::vector<float> y(size_t(N * ld), kSentinel);
            std::vector<float> xin = x;
            float* yp = in_place ? x.data() : y.data();
            k3::rmsnorm_forward(yp, x.data(), with_weight ? w.data() : nullptr, eps, N, D, ld);
            std::ostringstream cs;
            cs << "D=" << D << " ld=" << ld << " weight=" << with_weight << " in_place=" << in_place << " eps=" << eps;
            for (int64_t n = 0; n < N; ++n) {
              double ss = 0.0;
              for (int64_t d = 0; d < D; ++d) ss += double(xin[size_t(n * ld + d)]) * xin[size_t(n * ld + d)];
              const double r = 1.0 / std::sqrt(ss / double(D) + double(eps));
              for (int64_t d = 0; d < D; ++d) {
                const double ref = (with_weight ? double(w[size_t(d)]) : 1.0) * double(xin[size_t(n * ld + d)]) * r;
                const double got = yp[size_t(n * ld + d)];
                const double tol = (with_weight ? 3.0 : 2.0) * kU * (1.0 + 1e-6) * std::fabs(ref);
                const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
                auto at = [&] { return cs.str() + " y[" + std::to_string(n) + "," + std::to_string(d) + "]"; };
                worst.see(err, tol, at);
                ASSERT_LE(err, tol) << at() << " got " << got << " ref " << ref;
              }
              for (int64_t d = D; d < ld; ++d)
                ASSERT_TRUE(same_bits(yp[size_t(n * ld + d)], kSentinel))
                    << cs.str() << ": padding column " << d << " of row " << n << " was written";
            }
          }
}

double ref_situ(double g, double u) {
  const double sig = 1.0 / (1.0 + std::exp(-g));
  return (4.0 * std::tanh(g / 4.0) * sig) * (25.0 * std::tanh(u / 25.0));
}
double ref_swiglu(double g, double u) { return g / (1.0 + std::exp(-g)) * u; }

// fp32 operation counts (tanhf <= 2 ulp, expf <= 1 ulp, i.e. 4 and 2 units of 2^-24; each correctly rounded
// op 1 unit; a relative error in an argument passes through tanh with a factor <= 1):
//   SiTU: sigmoid 4 + tanh(g/4) 4 + product 1 + (u/25 1, tanh 4, x25 1) + final product 1 = 16 units.
//   SwiGLU: sigmoid 4 + two products 2 = 6 units.
constexpr double kSituTol = 16 * kU, kSwigluTol = 6 * kU;
// Below the fp32 normal range (sigmoid(g) for g < -87 is subnormal) relative bounds do not hold: there the
// sigmoid carries an absolute error of up to 2 subnormal ulps (2^-148 in all), which the other factor
// scales, and the products add subnormal roundings. Absolute floor: 2^-148 (1 + |other factor|), the other
// factor being bounded by 4 * 25 for SiTU and equal to g u for SwiGLU; 2^-148 (1 + |g|)(1 + |u|) covers
// the SwiGLU products' roundings too.
double subnormal_floor(bool situ, double g, double u) {
  return situ ? 0x1p-148 * (1.0 + 100.0) * 2.0 : 0x1p-148 * (1.0 + std::fabs(g)) * (1.0 + std::fabs(u));
}

TEST(Glu, SituAndSwigluMatchReference) {
  Worst ws("SiTU-GLU"), ww("SwiGLU");
  std::mt19937 rng(90);
  const int64_t n = 20000;
  std::vector<float> g = normal_vec(rng, n, 6.0f), u = normal_vec(rng, n, 20.0f);
  // A band of extreme but finite gate values, and a few exact special points.
  for (int64_t i = 0; i < 200; ++i) g[size_t(i)] = float(-120 + 1.2 * double(i));
  const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 4.0f, -4.0f, 25.0f, -25.0f, 87.0f, -87.0f, 103.0f, -103.0f};
  for (size_t i = 0; i < std::size(special); ++i)
    g[size_t(200 + i)] = special[i], u[size_t(200 + i)] = special[(i + 3) % std::size(special)];
  for (bool situ : {true, false}) {
    k3::GluParams p;
    p.situ = situ;
    std::vector<float> out(size_t(n), NAN);
    k3::glu_forward(out.data(), g.data(), u.data(), n, p);
    // Aliasing: out = gate, out = up.
    std::vector<float> ga = g, ua = u;
    k3::glu_forward(ga.data(), ga.data(), u.data(), n, p);
    k3::glu_forward(ua.data(), g.data(), ua.data(), n, p);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = situ ? ref_situ(g[size_t(i)], u[size_t(i)]) : ref_swiglu(g[size_t(i)], u[size_t(i)]);
      const double tol =
          (situ ? kSituTol : kSwigluTol) * std::fabs(ref) + subnormal_floor(situ, g[size_t(i)], u[size_t(i)]);
      const double got = out[size_t(i)];
      const double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
      auto at = [&] {
        return std::string(situ ? "situ" : "swiglu") + " g=" + std::to_string(g[size_t(i)]) +
               " u=" + std::to_string(u[size_t(i)]);
      };
      (situ ? ws : ww).see(err, tol, at);
      ASSERT_LE(err, tol) << at() << " got " << got << " ref " << ref;
      ASSERT_TRUE(same_bits(ga[size_t(i)], out[size_t(i)])) << at() << " (out aliases gate)";
      ASSERT_TRUE(same_bits(ua[size_t(i)], out[size_t(i)])) << at() << " (out aliases up)";
    }
  }
}

TEST(Glu, SituBoundedAndFiniteForHugeInputs) {
  const float vals[] = {1e30f,    -1e30f, 1e10f,   -1e10f,   3e38f,     -3e38f, 1000.0f,
                        -1000.0f, 100.0f, -100.0f, INFINITY, -INFINITY, 0.0f};
  std::vector<float> g, u;
  for (float a : vals)
    for (float b : vals) g.push_back(a), u.push_back(b);
  std::mt19937 rng(5);
  for (int i = 0; i < 1000; ++i) {
    g.push_back(normal_vec(rng, 1, 1e6f)[0]);
    u.push_back(normal_vec(rng, 1, 1e6f)[0]);
  }
  std::vector<float> out(g.size(), NAN);
  k3::GluParams p;
  k3::glu_forward(out.data(), g.data(), u.data(), int64_t(g.size()), p);
  double max_abs = 0.0;
  for (size_t i = 0; i < g.size(); ++i) {
    const std::string at = "g=" + std::to_string(g[i]) + " u=" + std::to_string(u[i]);
    ASSERT_TRUE(std::isfinite(out[i])) << at;
    ASSERT_LE(std::fabs(out[i]), 100.0f) << at;
    max_abs = std::max(max_abs, double(std::fabs(out[i])));
    const double ref = ref_situ(g[i], u[i]);
    ASSERT_LE(std::fabs(out[i] - ref), kSituTol * std::fabs(ref) + subnormal_floor(true, g[i], u[i]))
        << at << " got " << out[i] << " ref " << ref;
  }
  EXPECT_EQ(max_abs, 100.0);  // g, u -> +inf: 4 * 1 * 1 * 25
  std::printf("[info] SiTU max |out| over huge inputs: %.9g\n", max_abs);
}

}  // namespace
