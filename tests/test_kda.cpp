// Tests for the KDA CPU reference kernels (src/kernels/kda). Every test compares against an independent
// truth: a double-precision re-derivation, the recurrence (for the chunked form), or one call vs. a split.
// Standalone build:
//   g++ -std=c++20 -O2 -fopenmp -Isrc src/kernels/kda/kda_cpu.cpp tests/test_kda.cpp
//       -lgtest -lgtest_main -pthread -o /tmp/test_kda && /tmp/test_kda
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/kda/kda.h"

namespace {

using k3::kda::gate_forward;
using k3::kda::gated_rmsnorm_forward;
using k3::kda::kda_chunk_forward;
using k3::kda::kda_recurrent_forward;
using k3::kda::l2norm_heads;
using k3::kda::short_conv_silu_forward;
using Vec = std::vector<float>;
using DVec = std::vector<double>;  // KDA states are fp64

constexpr float kLowerBound = -5.0f;
// Tolerances follow from the kernels' precision: states are fp64 end to end (~1e-16 per operation,
// a few hundred operations deep), and o is the same fp64 value rounded once to fp32, so two correct
// forms can differ in o by at most one fp32 rounding (6e-8 relative) on the rare element whose fp64
// values straddle a rounding boundary.
constexpr double kStateTol = 1e-12;
constexpr double kOutTol = 1e-7;

// ||a - b|| / ||b|| in double.
template <class A, class B>
double rel_l2(const A& a, const B& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

template <class V>
bool all_finite(const V& a) {
  for (auto x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

Vec normal(std::mt19937& rng, size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Inputs of one KDA call. q and k are L2-normalised per head (as in K3), beta in (0, 1), the state nonzero.
struct KdaCase {
  int64_t T, H, Dk, Dv;
  Vec q, k, v, g, beta;
  DVec state0;
  float scale;
};

// g is drawn per token from four modes so that both extremes occur: every channel exactly at the -5 lower
// bound, every channel near 0 (almost no decay), uniform in [-5, 0], and a per-channel mix of those. When
// T >= 100 tokens 20..89 are all exactly -5, so a 64-token chunk sees Gamma down to -320 (the overflow trap).
KdaCase make_case(int64_t T, int64_t H, int64_t Dk, int64_t Dv, uint32_t seed) {
  std::mt19937 rng(seed);
  KdaCase c{T, H, Dk, Dv, {}, {}, {}, {}, {}, {}, 1.0f / std::sqrt(float(Dk))};
  c.q = normal(rng, T * H * Dk);
  c.k = normal(rng, T * H * Dk);
  c.v = normal(rng, T * H * Dv);
  for (Vec* x : {&c.q, &c.k}) {  // L2 normalise in double (independent of l2norm_heads)
    for (int64_t r = 0; r < T * H; ++r) {
      double ss = 0;
      for (int64_t d = 0; d < Dk; ++d) ss += double((*x)[r * Dk + d]) * (*x)[r * Dk + d];
      for (int64_t d = 0; d < Dk; ++d) (*x)[r * Dk + d] = float((*x)[r * Dk + d] / std::sqrt(ss));
    }
  }
  std::uniform_int_distribution<int> mode(0, 3);
  std::uniform_real_distribution<float> unif(kLowerBound, 0.0f), near0(-1e-3f, 0.0f), b(0.01f, 0.99f);
  auto draw = [&](int m) { return m == 0 ? kLowerBound : m == 1 ? near0(rng) : unif(rng); };
  c.g.resize(T * H * Dk);
  for (int64_t t = 0; t < T; ++t) {
    const int m = (T >= 100 && t >= 20 && t < 90) ? 0 : mode(rng);
    for (int64_t i = 0; i < H * Dk; ++i) c.g[t * H * Dk + i] = draw(m == 3 ? mode(rng) % 3 : m);
  }
  c.beta.resize(T * H);
  for (auto& x : c.beta) x = b(rng);
  const Vec s0 = normal(rng, H * Dk * Dv, 0.5f);
  c.state0.assign(s0.begin(), s0.end());
  return c;
}

struct KdaOut {
  Vec o;
  DVec state;
};

KdaOut run_recurrent(const KdaCase& c) {
  KdaOut r{Vec(c.T * c.H * c.Dv), c.state0};
  kda_recurrent_forward(r.o.data(), c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.scale,
                        r.state.data(), c.T, c.H, c.Dk, c.Dv);
  return r;
}

KdaOut run_chunk(const KdaCase& c, int chunk) {
  KdaOut r{Vec(c.T * c.H * c.Dv), c.state0};
  kda_chunk_forward(r.o.data(), c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.scale, r.state.data(),
                    c.T, c.H, c.Dk, c.Dv, chunk);
  return r;
}

// ---------------------------------------------------------------------------------------------------------
// Recurrence against an independent dense re-derivation in double:
//   S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T,   o_t = S_t^T q_t * scale   (K3 eq. 1)
// with every matrix formed explicitly.
TEST(KdaRecurrent, MatchesDenseDoubleDerivation) {
  const int64_t T = 24, H = 2, Dk = 6, Dv = 4;
  const KdaCase c = make_case(T, H, Dk, Dv, 1234);
  const KdaOut got = run_recurrent(c);

  Vec ref_o(T * H * Dv);
  DVec ref_state(H * Dk * Dv);
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> S(Dk * Dv);
    for (int64_t i = 0; i < Dk * Dv; ++i) S[i] = c.state0[h * Dk * Dv + i];
    for (int64_t t = 0; t < T; ++t) {
      const float* k = &c.k[(t * H + h) * Dk];
      const float* q = &c.q[(t * H + h) * Dk];
      const float* v = &c.v[(t * H + h) * Dv];
      const float* g = &c.g[(t * H + h) * Dk];
      const double b = c.beta[t * H + h];
      std::vector<double> P(Dk * Dk), DS(Dk * Dv), Sn(Dk * Dv, 0.0);
      for (int64_t r = 0; r < Dk; ++r)
        for (int64_t s = 0; s < Dk; ++s) P[r * Dk + s] = (r == s ? 1.0 : 0.0) - b * double(k[r]) * k[s];
      for (int64_t r = 0; r < Dk; ++r)
        for (int64_t j = 0; j < Dv; ++j) DS[r * Dv + j] = std::exp(double(g[r])) * S[r * Dv + j];
      for (int64_t r = 0; r < Dk; ++r)
        for (int64_t j = 0; j < Dv; ++j) {
          double acc = b * double(k[r]) * v[j];
          for (int64_t s = 0; s < Dk; ++s) acc += P[r * Dk + s] * DS[s * Dv + j];
          Sn[r * Dv + j] = acc;
        }
      S = Sn;
      for (int64_t j = 0; j < Dv; ++j) {
        double acc = 0;
        for (int64_t r = 0; r < Dk; ++r) acc += S[r * Dv + j] * q[r];
        ref_o[(t * H + h) * Dv + j] = float(acc * c.scale);
      }
    }
    for (int64_t i = 0; i < Dk * Dv; ++i) ref_state[h * Dk * Dv + i] = S[i];
  }
  const double eo = rel_l2(got.o, ref_o), es = rel_l2(got.state, ref_state);
  std::printf("[recurrent vs dense double] rel L2: o %.3g, state %.3g\n", eo, es);
  EXPECT_LE(eo, kOutTol);
  EXPECT_LE(es, kStateTol);
}

// ---------------------------------------------------------------------------------------------------------
// Chunked == recurrence for every chunk size 1..64 and awkward lengths, Dk == Dv and Dk != Dv. Dk = 20,
// Dv = 40 are not multiples of the 8 x 16 matmul tile, so the edge paths run too.
TEST(KdaChunk, MatchesRecurrenceAllChunkSizes) {
  const int64_t lengths[] = {1, 15, 16, 17, 63, 64, 65, 100, 129};
  const int64_t dims[][2] = {{16, 16}, {32, 16}, {20, 40}};
  double worst_o = 0, worst_s = 0;
  for (const auto& dd : dims) {
    for (const int64_t T : lengths) {
      const KdaCase c = make_case(T, 2, dd[0], dd[1], uint32_t(1000 + T * 7 + dd[0]));
      const KdaOut ref = run_recurrent(c);
      ASSERT_TRUE(all_finite(ref.o) && all_finite(ref.state));
      for (int chunk = 1; chunk <= 64; ++chunk) {
        const KdaOut got = run_chunk(c, chunk);
        const std::string where = "T=" + std::to_string(T) + " Dk=" + std::to_string(dd[0]) +
                                  " Dv=" + std::to_string(dd[1]) + " chunk=" + std::to_string(chunk);
        ASSERT_TRUE(all_finite(got.o) && all_finite(got.state)) << where;
        const double eo = rel_l2(got.o, ref.o), es = rel_l2(got.state, ref.state);
        worst_o = std::max(worst_o, eo);
        worst_s = std::max(worst_s, es);
        EXPECT_LE(eo, kOutTol) << "o: " << where;
        EXPECT_LE(es, kStateTol) << "state: " << where;
      }
    }
  }
  std::printf("[chunk vs recurrent, 1728 cases] worst rel L2: o %.3g, state %.3g\n", worst_o, worst_s);
}

// The production shape per head (Dk = Dv = 128) at the production chunk sizes.
TEST(KdaChunk, MatchesRecurrenceK3HeadDim) {
  const KdaCase c = make_case(200, 2, 128, 128, 77);
  const KdaOut ref = run_recurrent(c);
  for (int chunk : {16, 32, 64}) {
    const KdaOut got = run_chunk(c, chunk);
    const double eo = rel_l2(got.o, ref.o), es = rel_l2(got.state, ref.state);
    std::printf("[chunk %d vs recurrent, D=128, T=200] rel L2: o %.3g, state %.3g\n", chunk, eo, es);
    EXPECT_LE(eo, kOutTol) << "chunk=" << chunk;
    EXPECT_LE(es, kStateTol) << "chunk=" << chunk;
  }
}

// Every g exactly at the lower bound over whole 64-token chunks: Gamma reaches -320 inside a chunk, where
// exp(-Gamma) = e^320 would overflow fp32. The chunked form must stay finite and equal the recurrence.
TEST(KdaChunk, StrongestDecayDoesNotOverflow) {
  KdaCase c = make_case(128, 2, 16, 16, 5);
  for (auto& x : c.g) x = kLowerBound;
  const KdaOut ref = run_recurrent(c);
  const KdaOut got = run_chunk(c, 64);
  ASSERT_TRUE(all_finite(got.o) && all_finite(got.state));
  EXPECT_LE(rel_l2(got.o, ref.o), kOutTol);
  EXPECT_LE(rel_l2(got.state, ref.state), kStateTol);
}

// ---------------------------------------------------------------------------------------------------------
// A sequence processed in two calls (state carried) equals one call.
TEST(KdaRecurrent, SplitCallsEqualOneCall) {
  const KdaCase c = make_case(100, 2, 32, 16, 99);
  const KdaOut whole = run_recurrent(c);
  for (int64_t split : {1, 37, 64, 99}) {
    Vec o(c.T * c.H * c.Dv);
    DVec st = c.state0;
    const int64_t a = split * c.H;
    kda_recurrent_forward(o.data(), c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.scale, st.data(),
                          split, c.H, c.Dk, c.Dv);
    kda_recurrent_forward(o.data() + a * c.Dv, c.q.data() + a * c.Dk, c.k.data() + a * c.Dk, c.v.data() + a * c.Dv,
                          c.g.data() + a * c.Dk, c.beta.data() + a, c.scale, st.data(), c.T - split, c.H, c.Dk, c.Dv);
    // Token by token the arithmetic is identical, so the results are bit-identical.
    EXPECT_EQ(o, whole.o) << "split=" << split;
    EXPECT_EQ(st, whole.state) << "split=" << split;
  }
}

TEST(KdaChunk, SplitCallsEqualOneCall) {
  const KdaCase c = make_case(100, 2, 32, 16, 98);
  const KdaOut whole = run_chunk(c, 16);
  for (int64_t split : {1, 37, 64, 99}) {
    Vec o(c.T * c.H * c.Dv);
    DVec st = c.state0;
    const int64_t a = split * c.H;
    kda_chunk_forward(o.data(), c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.scale, st.data(),
                      split, c.H, c.Dk, c.Dv, 16);
    kda_chunk_forward(o.data() + a * c.Dv, c.q.data() + a * c.Dk, c.k.data() + a * c.Dk, c.v.data() + a * c.Dv,
                      c.g.data() + a * c.Dk, c.beta.data() + a, c.scale, st.data(), c.T - split, c.H, c.Dk, c.Dv, 16);
    // Chunk boundaries move with the split, so only rounding may differ.
    EXPECT_LE(rel_l2(o, whole.o), kOutTol) << "split=" << split;
    EXPECT_LE(rel_l2(st, whole.state), kStateTol) << "split=" << split;
  }
}

TEST(KdaChunk, RejectsBadArguments) {
  const KdaCase c = make_case(8, 1, 4, 4, 3);
  Vec o(8 * 4);
  DVec st = c.state0;
  auto call = [&](int64_t T, int64_t H, int64_t Dk, int64_t Dv, int chunk) {
    kda_chunk_forward(o.data(), c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.scale, st.data(), T, H,
                      Dk, Dv, chunk);
  };
  EXPECT_THROW(call(8, 1, 4, 4, 0), k3::Error);
  EXPECT_THROW(call(8, 1, 4, 4, -3), k3::Error);
  EXPECT_THROW(call(8, 0, 4, 4, 16), k3::Error);
  EXPECT_THROW(call(8, 1, 0, 4, 16), k3::Error);
  EXPECT_THROW(call(8, 1, 4, 0, 16), k3::Error);
  try {
    call(8, 1, 4, 4, 0);
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_size"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kda_recurrent_forward(o.data(), c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.scale,
                                     st.data(), 8, 1, 4, 0),
               k3::Error);
}

// ---------------------------------------------------------------------------------------------------------
// Short conv + SiLU against a direct double-precision reference over [history ; x].
// hist: [K-1][C] (oldest first), zeros for a fresh sequence.
std::vector<double> conv_ref(const Vec& x, int64_t T, int64_t C, const Vec& w, int K, const Vec& hist) {
  const int64_t P = K - 1;
  std::vector<double> out(T * C);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double y = 0;
      for (int j = 0; j < K; ++j) {
        const int64_t s = t - P + j;
        const double in = s >= 0 ? x[s * C + c] : hist[(P + s) * C + c];
        y += double(w[c * K + j]) * in;
      }
      out[t * C + c] = y / (1.0 + std::exp(-y));
    }
  return out;
}

void expect_conv_close(const Vec& got, const std::vector<double>& ref, const std::string& where) {
  ASSERT_EQ(got.size(), ref.size()) << where;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], ref[i], 1e-6 * (1.0 + std::fabs(ref[i]))) << where << " at " << i;
}

TEST(ShortConv, MatchesDoubleReference) {
  std::mt19937 rng(11);
  for (int K : {1, 2, 4, 5}) {
    const int64_t T = 23, C = 13, P = K - 1;
    const Vec x = normal(rng, T * C), w = normal(rng, C * K, 0.5f), hist = normal(rng, P * C);
    // Fresh sequence (tail == nullptr): history is zeros.
    Vec out(T * C);
    short_conv_silu_forward(out.data(), x.data(), T, C, w.data(), K, nullptr);
    expect_conv_close(out, conv_ref(x, T, C, w, K, Vec(P * C, 0.0f)), "K=" + std::to_string(K) + " fresh");
    // With a history; the tail must then hold the last K-1 inputs.
    Vec tail = hist;
    short_conv_silu_forward(out.data(), x.data(), T, C, w.data(), K, tail.data());
    expect_conv_close(out, conv_ref(x, T, C, w, K, hist), "K=" + std::to_string(K) + " with tail");
    EXPECT_EQ(tail, Vec(x.end() - P * C, x.end())) << "K=" << K;
  }
}

TEST(ShortConv, SplitPiecesEqualOneCall) {
  std::mt19937 rng(12);
  const int K = 4;
  const int64_t C = 9, pieces[] = {1, 2, 5, 1, 3, 8, 2, 1, 6}, T = 29;
  const Vec x = normal(rng, T * C), w = normal(rng, C * K, 0.5f), hist = normal(rng, (K - 1) * C);
  Vec whole(T * C), tail_whole = hist;
  short_conv_silu_forward(whole.data(), x.data(), T, C, w.data(), K, tail_whole.data());

  Vec split(T * C), tail = hist;
  int64_t t0 = 0;
  for (int64_t n : pieces) {
    short_conv_silu_forward(split.data() + t0 * C, x.data() + t0 * C, n, C, w.data(), K, tail.data());
    t0 += n;
  }
  ASSERT_EQ(t0, T);
  // The taps are summed in the same order whichever buffer an input comes from: bit-identical.
  EXPECT_EQ(split, whole);
  EXPECT_EQ(tail, tail_whole);
}

TEST(ShortConv, ShortCallsShiftTheTail) {
  const int K = 4;
  const int64_t C = 2;
  // Tail rows a, b, c (oldest first); rows are {10r, 10r+1}.
  Vec tail = {0, 1, 10, 11, 20, 21};
  const Vec w(C * K, 0.25f);
  Vec out(2 * C);
  const Vec d = {30, 31};
  short_conv_silu_forward(out.data(), d.data(), 1, C, w.data(), K, tail.data());  // T = 1 < K-1
  EXPECT_EQ(tail, (Vec{10, 11, 20, 21, 30, 31}));
  const Vec ef = {40, 41, 50, 51};
  short_conv_silu_forward(out.data(), ef.data(), 2, C, w.data(), K, tail.data());  // T = 2 < K-1
  EXPECT_EQ(tail, (Vec{30, 31, 40, 41, 50, 51}));
  short_conv_silu_forward(out.data(), ef.data(), 0, C, w.data(), K, tail.data());  // T = 0: unchanged
  EXPECT_EQ(tail, (Vec{30, 31, 40, 41, 50, 51}));
  // Output of the last real token (50, 51): taps over 20|21, 30|31, 40|41, 50|51 at weight 0.25.
  const double y0 = 0.25 * (20 + 30 + 40 + 50);
  EXPECT_NEAR(out[2], y0 / (1 + std::exp(-y0)), 1e-4);
}

TEST(ShortConv, RejectsBadArguments) {
  Vec x(4), out(4), w(4);
  EXPECT_THROW(short_conv_silu_forward(out.data(), x.data(), 4, 1, w.data(), 0, nullptr), k3::Error);
  EXPECT_THROW(short_conv_silu_forward(out.data(), x.data(), 4, 0, w.data(), 4, nullptr), k3::Error);
  EXPECT_THROW(short_conv_silu_forward(out.data(), x.data(), -1, 1, w.data(), 4, nullptr), k3::Error);
}

// ---------------------------------------------------------------------------------------------------------
TEST(Gate, MatchesFormulaAndStaysInBounds) {
  std::mt19937 rng(21);
  const int64_t T = 17, H = 3, D = 8;
  const Vec z = normal(rng, T * H * D, 2.0f), dt = normal(rng, H * D, 0.5f);
  const Vec A_log = {0.0f, 0.7f, -0.4f};  // K3 initialises A_log to 0
  Vec g(T * H * D);
  gate_forward(g.data(), z.data(), A_log.data(), dt.data(), kLowerBound, T, H, D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = (t * H + h) * D + d;
        const double arg = std::exp(double(A_log[h])) * (double(z[i]) + dt[h * D + d]);
        const double ref = double(kLowerBound) / (1.0 + std::exp(-arg));
        ASSERT_NEAR(g[i], ref, 1e-6) << "t=" << t << " h=" << h << " d=" << d;
        ASSERT_GT(g[i], kLowerBound) << "t=" << t << " h=" << h << " d=" << d;  // moderate |arg|: strict
        ASSERT_LT(g[i], 0.0f) << "t=" << t << " h=" << h << " d=" << d;
      }
}

// For huge |z| sigmoid saturates in fp32: g may reach exactly lower_bound or -0, never beyond, never NaN.
TEST(Gate, SaturatesWithinClosedBounds) {
  const Vec z = {-1e30f, -100.0f, 100.0f, 1e30f}, dt(4, 0.0f), A_log = {2.0f};
  Vec g(4);
  gate_forward(g.data(), z.data(), A_log.data(), dt.data(), kLowerBound, 1, 1, 4);
  for (float x : g) {
    EXPECT_TRUE(std::isfinite(x));
    EXPECT_GE(x, kLowerBound);
    EXPECT_LE(x, 0.0f);
    EXPECT_GE(std::exp(x), std::exp(kLowerBound));  // alpha >= e^-5
  }
  EXPECT_EQ(g[3], kLowerBound);
  EXPECT_THROW(gate_forward(g.data(), z.data(), A_log.data(), dt.data(), 0.0f, 1, 1, 4), k3::Error);
}

TEST(L2Norm, MatchesDoubleReference) {
  std::mt19937 rng(31);
  const int64_t T = 5, H = 3, D = 16;
  Vec x = normal(rng, T * H * D, 3.0f);
  for (int64_t d = 0; d < D; ++d) x[D + d] = 0.0f;  // an all-zero head: eps keeps it 0, not NaN
  const Vec x0 = x;
  l2norm_heads(x.data(), T, H, D, 1e-6f);
  for (int64_t r = 0; r < T * H; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += double(x0[r * D + d]) * x0[r * D + d];
    for (int64_t d = 0; d < D; ++d)
      ASSERT_NEAR(x[r * D + d], x0[r * D + d] / std::sqrt(ss + 1e-6), 1e-6) << "row " << r << " d " << d;
  }
  EXPECT_THROW(l2norm_heads(x.data(), T, H, 0, 1e-6f), k3::Error);
}

std::vector<double> gated_rmsnorm_ref(const Vec& o, const Vec& gate, const Vec& w, double eps, int64_t rows,
                                      int64_t Dv) {
  std::vector<double> y(rows * Dv);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t d = 0; d < Dv; ++d) ss += double(o[r * Dv + d]) * o[r * Dv + d];
    const double inv = 1.0 / std::sqrt(ss / Dv + eps);
    for (int64_t d = 0; d < Dv; ++d)
      y[r * Dv + d] = o[r * Dv + d] * inv * w[d] / (1.0 + std::exp(-double(gate[r * Dv + d])));
  }
  return y;
}

TEST(GatedRmsNorm, MatchesDoubleReferenceAndWorksInPlace) {
  std::mt19937 rng(41);
  const int64_t T = 6, H = 4, Dv = 32;
  const Vec o = normal(rng, T * H * Dv, 0.3f), gate = normal(rng, T * H * Dv, 2.0f), w = normal(rng, Dv);
  const auto ref = gated_rmsnorm_ref(o, gate, w, 1e-5, T * H, Dv);
  Vec y(T * H * Dv);
  gated_rmsnorm_forward(y.data(), o.data(), gate.data(), w.data(), 1e-5f, T, H, Dv);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], ref[i], 1e-5 * (1 + std::fabs(ref[i]))) << "at " << i;
  Vec inplace = o;
  gated_rmsnorm_forward(inplace.data(), inplace.data(), gate.data(), w.data(), 1e-5f, T, H, Dv);
  EXPECT_EQ(inplace, y);
}

}  // namespace
