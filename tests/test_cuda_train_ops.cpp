// The fp32 CUDA training ops against their float64 CPU twins on random inputs of awkward sizes:
// RMSNorm with saved statistics (norm_train_cuda.h vs k3::rmsnorm_forward_saved / _backward_saved),
// Block AttnRes (attnres_train_cuda.h vs the double k3::attnres_forward / attnres_backward), the
// token embedding gather and scatter-add (embedding_cuda.h vs TrainBackend::embed_backward's loop),
// and the vocabulary-chunked cross-entropy (cross_entropy_cuda.h vs k3::cross_entropy).
// GPU tests skip without a Hopper GPU (K3_REQUIRE_GPU); the host helper and the argument checks
// (which throw before anything reaches the device) run everywhere the CUDA backend is built.
//
// Tolerance: relative L2 against the double truth (non-finite values fail first) <= 1e-5 for every output
// and gradient: fp32 math against float64 on the same fp32 inputs. Accumulated (+=) outputs start
// from random values and are compared by their increments (got − start vs ref − start), so the
// start does not dilute the error. Outputs with strides are written into buffers whose padding
// columns hold a sentinel, checked unchanged. Results that must be reproducible are run twice and
// compared bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "core/cuda.h"
#include "core/error.h"
#include "kernels/attnres/attnres.h"
#include "kernels/attnres/attnres_train_cuda.h"
#include "kernels/embed/embedding_cuda.h"
#include "kernels/loss/cross_entropy.h"
#include "kernels/loss/cross_entropy_cuda.h"
#include "kernels/norm/norm.h"
#include "kernels/norm/norm_train_cuda.h"
#include "util/random.h"

namespace {

namespace kc = k3::cuda;

constexpr double kTol = 1e-5;
constexpr float kSentinel = -777.25f;  // padding columns: must come back unchanged

std::vector<float> randf(int64_t n, uint64_t seed, double scale = 1.0) {
  const auto d = k3test::randn(n, seed);
  std::vector<float> v(d.size());
  for (size_t i = 0; i < d.size(); ++i) v[i] = float(d[i] * scale);
  return v;
}
std::vector<double> to_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

template <class T>
std::vector<T> download(const kc::DeviceBuffer<T>& b) {
  std::vector<T> h(b.size());
  b.download(h.data(), h.size());
  return h;
}

// ||a − b|| / ||b|| with a in fp32 and b the double truth; +inf on any non-finite value.
double rel_l2(const std::vector<float>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}
// Increments of an accumulated output: got − start against ref − start.
double rel_l2_increment(const std::vector<float>& got, const std::vector<float>& start,
                        const std::vector<double>& ref) {
  if (got.size() != start.size() || ref.size() != start.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) return INFINITY;
    const double dg = double(got[i]) - double(start[i]), dr = ref[i] - double(start[i]);
    num += (dg - dr) * (dg - dr);
    den += dr * dr;
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// [rows, cols] at stride ld, padding = kSentinel.
std::vector<float> strided(const std::vector<float>& v, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> o(size_t(rows * ld), kSentinel);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) o[size_t(i * ld + j)] = v[size_t(i * cols + j)];
  return o;
}
// The [rows, cols] block of a strided buffer; *bad says when a padding column is not the sentinel.
std::vector<float> unstride(const std::vector<float>& o, int64_t rows, int64_t cols, int64_t ld, std::string* bad) {
  std::vector<float> v(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) v[size_t(i * cols + j)] = o[size_t(i * ld + j)];
    for (int64_t j = cols; j < ld; ++j)
      if (o[size_t(i * ld + j)] != kSentinel)
        *bad = "padding column " + std::to_string(j) + " of row " + std::to_string(i) + " overwritten";
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

struct NormCase {
  int64_t N, D, ldx, ldy, lddy, lddx;
};

TEST(CudaTrainOps, RmsNormMatchesCpu) {
  K3_REQUIRE_GPU();
  const NormCase cases[] = {
      {37, 72, 72, 72, 72, 72},           // contiguous, D not a multiple of 32
      {37, 130, 200, 144, 131, 160},      // every stride different, > D (column slices)
      {1, 7168, 7168, 7168, 7168, 7168},  // one row at the hidden size
      {37, 7168, 7232, 7200, 7169, 7170},
      {129, 512, 576, 576, 512, 576},  // two dw chunks (128 rows each), the second of one row
      {300, 33, 40, 33, 35, 33},       // three dw chunks, a tiny row
  };
  const float eps = 1e-6f;
  for (const NormCase& c : cases)
    for (bool with_w : {true, false})
      for (bool with_dw : {true, false}) {
        const int64_t N = c.N, D = c.D;
        const std::string ctx = "N=" + std::to_string(N) + " D=" + std::to_string(D) + " ldx=" + std::to_string(c.ldx) +
                                (with_w ? " weight" : " no weight") + (with_dw ? " dw" : " no dw");
        const uint64_t seed = uint64_t(N * 1000 + D);
        auto x = randf(N * D, seed, 2.0);
        for (int64_t n = 0; n < N; ++n)  // rows of different scale
          for (int64_t d = 0; d < D; ++d) x[size_t(n * D + d)] *= float(0.25 + 0.1 * double(n % 17));
        auto w = randf(D, seed + 1, 0.3);
        for (auto& e : w) e += 1.0f;
        const auto dy = randf(N * D, seed + 2);
        const auto dw0 = randf(D, seed + 3);

        // Truth: float64 with the same fp32 inputs.
        const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
        std::vector<double> y_ref(size_t(N * D)), xhat(size_t(N * D)), rs(static_cast<size_t>(N)),
            dx_ref(size_t(N * D));
        std::vector<double> dw_ref = to_double(dw0);
        k3::rmsnorm_forward_saved(y_ref.data(), xhat.data(), rs.data(), xd.data(), D, with_w ? wd.data() : nullptr,
                                  double(eps), N, D);
        k3::rmsnorm_backward_saved(dx_ref.data(), D, with_dw ? dw_ref.data() : nullptr, dyd.data(), xhat.data(),
                                   rs.data(), with_w ? wd.data() : nullptr, N, D);

        // GPU: x's padding holds the sentinel too (never read).
        const auto xs = strided(x, N, D, c.ldx), dys = strided(dy, N, D, c.lddy);
        const std::vector<float> y_init(size_t(N * c.ldy), kSentinel), dx_init(size_t(N * c.lddx), kSentinel);
        kc::DeviceBuffer<float> gx(xs.data(), xs.size()), gw(w.data(), w.size()), gdy(dys.data(), dys.size());
        kc::DeviceBuffer<float> gy(y_init.data(), y_init.size()), grstd(static_cast<size_t>(N)),
            gdx(dx_init.data(), dx_init.size()), gdw(dw0.data(), dw0.size());
        kc::DeviceBuffer<uint8_t> ws(std::max<size_t>(1, k3::norm::cuda::rmsnorm_backward_workspace_bytes(N, D)));
        const float* wp = with_w ? gw.data() : nullptr;
        k3::norm::cuda::rmsnorm_forward_train(gy.data(), c.ldy, grstd.data(), gx.data(), c.ldx, wp, eps, N, D);
        k3::norm::cuda::rmsnorm_backward_train(gdx.data(), c.lddx, with_dw ? gdw.data() : nullptr, gdy.data(), c.lddy,
                                               gx.data(), c.ldx, grstd.data(), wp, N, D, ws.data());
        kc::synchronize();

        std::string bad;
        const auto y = unstride(download(gy), N, D, c.ldy, &bad);
        const auto dx = unstride(download(gdx), N, D, c.lddx, &bad);
        ASSERT_TRUE(bad.empty()) << bad << " (" << ctx << ")";
        EXPECT_LE(rel_l2(y, y_ref), kTol) << "y, " << ctx;
        EXPECT_LE(rel_l2(download(grstd), rs), kTol) << "rstd, " << ctx;
        EXPECT_LE(rel_l2(dx, dx_ref), kTol) << "dx, " << ctx;
        const auto dw = download(gdw);
        if (with_dw) EXPECT_LE(rel_l2_increment(dw, dw0, dw_ref), kTol) << "dw, " << ctx;
        else EXPECT_TRUE(same_bits(dw, dw0)) << "dw touched without dw, " << ctx;

        // Reproducible bit for bit, and dx may overwrite dy in place (same stride).
        if (with_dw && c.lddx == c.lddy) {
          kc::DeviceBuffer<float> gdw2(dw0.data(), dw0.size()), ginplace(dys.data(), dys.size());
          k3::norm::cuda::rmsnorm_backward_train(ginplace.data(), c.lddy, gdw2.data(), ginplace.data(), c.lddy,
                                                 gx.data(), c.ldx, grstd.data(), wp, N, D, ws.data());
          kc::synchronize();
          EXPECT_TRUE(same_bits(download(gdw2), dw)) << "dw not reproducible, " << ctx;
          std::string bad2;
          const auto dx2 = unstride(download(ginplace), N, D, c.lddy, &bad2);
          EXPECT_TRUE(same_bits(dx2, dx)) << "in-place dx differs, " << ctx;
        }
        // y may overwrite x in place (same stride).
        if (c.ldx == c.ldy) {
          kc::DeviceBuffer<float> gxy(xs.data(), xs.size()), grstd2(static_cast<size_t>(N));
          k3::norm::cuda::rmsnorm_forward_train(gxy.data(), c.ldx, grstd2.data(), gxy.data(), c.ldx, wp, eps, N, D);
          kc::synchronize();
          std::string bad3;
          EXPECT_TRUE(same_bits(unstride(download(gxy), N, D, c.ldx, &bad3), y)) << "in-place y differs, " << ctx;
          EXPECT_TRUE(same_bits(download(grstd2), download(grstd))) << "in-place rstd differs, " << ctx;
        }
      }
}

// ---------------------------------------------------------------------------------------------
// AttnRes

// The softmax weights and 1/rms of the double twin (attnres_cpu.cpp's attnres_row), for the saved
// statistics.
void attnres_stats_ref(std::vector<double>& alpha, std::vector<double>& rinv,
                       const std::vector<std::vector<double>>& src, const std::vector<double>& q, double eps, int64_t N,
                       int64_t D) {
  const size_t S = src.size();
  alpha.assign(size_t(N) * S, 0.0);
  rinv.assign(size_t(N) * S, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> s(S);
    double mx = -INFINITY;
    for (size_t i = 0; i < S; ++i) {
      double ss = 0.0, dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double v = src[i][size_t(n * D + d)];
        ss += v * v;
        dot += v * q[size_t(d)];
      }
      const double r = 1.0 / std::sqrt(ss / double(D) + eps);
      rinv[size_t(n) * S + i] = r;
      s[i] = dot * r;
      mx = std::max(mx, s[i]);
    }
    double z = 0.0;
    for (size_t i = 0; i < S; ++i) z += (s[i] = std::exp(s[i] - mx));
    for (size_t i = 0; i < S; ++i) alpha[size_t(n) * S + i] = s[i] / z;
  }
}

TEST(CudaTrainOps, AttnResMatchesCpu) {
  K3_REQUIRE_GPU();
  namespace ar = k3::attnres::cuda;
  struct Case {
    int S;
    int64_t N, D;
  };
  const Case cases[] = {{1, 37, 72},   {2, 37, 72},   {9, 37, 72},  {9, 37, 130},
                        {2, 37, 7168}, {9, 37, 7168}, {9, 300, 72}, {16, 5, 40}};  // 300: three dq chunks
  const float eps = 1e-5f;
  for (const Case& c : cases) {
    const int S = c.S;
    const int64_t N = c.N, D = c.D;
    const std::string ctx = "S=" + std::to_string(S) + " N=" + std::to_string(N) + " D=" + std::to_string(D);
    const uint64_t seed = uint64_t(S * 100000 + N * 100 + D);
    std::vector<std::vector<float>> src(static_cast<size_t>(S));
    for (int i = 0; i < S; ++i) {
      src[size_t(i)] = randf(N * D, seed + uint64_t(i), 0.5 + 0.3 * i);  // sources of different RMS
      src[size_t(i)][size_t(i % N) * size_t(D)] += 3.0f;                 // and an outlier
    }
    const auto q = randf(D, seed + 50, 2.0 / std::sqrt(double(D)));  // scores of O(1): a soft softmax
    const auto dh = randf(N * D, seed + 51);
    std::vector<std::vector<float>> dsrc0(static_cast<size_t>(S));
    for (int i = 0; i < S; ++i) dsrc0[size_t(i)] = randf(N * D, seed + 60 + uint64_t(i));
    const auto dq0 = randf(D, seed + 99);

    // Truth.
    std::vector<std::vector<double>> srcd(static_cast<size_t>(S)), dsrcd(static_cast<size_t>(S));
    std::vector<const double*> sp(static_cast<size_t>(S));
    std::vector<double*> dsp(static_cast<size_t>(S));
    for (int i = 0; i < S; ++i) {
      srcd[size_t(i)] = to_double(src[size_t(i)]);
      dsrcd[size_t(i)] = to_double(dsrc0[size_t(i)]);
      sp[size_t(i)] = srcd[size_t(i)].data();
      dsp[size_t(i)] = dsrcd[size_t(i)].data();
    }
    const auto qd = to_double(q), dhd = to_double(dh);
    std::vector<double> h_ref(size_t(N * D)), dq_ref = to_double(dq0), alpha_ref, rinv_ref;
    k3::attnres_forward(h_ref.data(), sp, qd.data(), double(eps), N, D);
    k3::attnres_backward(dsp, dq_ref.data(), dhd.data(), sp, qd.data(), double(eps), N, D);
    attnres_stats_ref(alpha_ref, rinv_ref, srcd, qd, double(eps), N, D);

    // GPU.
    std::vector<kc::DeviceBuffer<float>> gsrc, gdsrc;
    for (int i = 0; i < S; ++i) {
      gsrc.emplace_back(src[size_t(i)].data(), src[size_t(i)].size());
      gdsrc.emplace_back(dsrc0[size_t(i)].data(), dsrc0[size_t(i)].size());
    }
    kc::DeviceBuffer<float> gq(q.data(), q.size()), gdh(dh.data(), dh.size()), gdq(dq0.data(), dq0.size());
    kc::DeviceBuffer<float> gh(size_t(N * D)), galpha(size_t(N) * size_t(S)), grinv(size_t(N) * size_t(S));
    kc::DeviceBuffer<uint8_t> ws(ar::attnres_backward_workspace_bytes(N, D, S));

    ar::AttnResTrainParams fp;
    for (int i = 0; i < S; ++i) fp.sources[i] = gsrc[size_t(i)].data();
    fp.S = S, fp.N = N, fp.D = D, fp.query = gq.data(), fp.eps = eps;
    fp.h = gh.data(), fp.alpha = galpha.data(), fp.rinv = grinv.data();
    ar::attnres_forward_train(fp);

    ar::AttnResBackwardParams bp;
    for (int i = 0; i < S; ++i) bp.sources[i] = gsrc[size_t(i)].data(), bp.dsources[i] = gdsrc[size_t(i)].data();
    bp.S = S, bp.N = N, bp.D = D, bp.query = gq.data(), bp.eps = eps;
    bp.alpha = galpha.data(), bp.rinv = grinv.data(), bp.dh = gdh.data(), bp.dquery = gdq.data();
    bp.workspace = ws.data();
    ar::attnres_backward_train(bp);
    kc::synchronize();

    EXPECT_LE(rel_l2(download(gh), h_ref), kTol) << "h, " << ctx;
    EXPECT_LE(rel_l2(download(galpha), alpha_ref), kTol) << "alpha, " << ctx;
    EXPECT_LE(rel_l2(download(grinv), rinv_ref), kTol) << "rinv, " << ctx;
    std::vector<std::vector<float>> dsrc(static_cast<size_t>(S));
    for (int i = 0; i < S; ++i) {
      dsrc[size_t(i)] = download(gdsrc[size_t(i)]);
      EXPECT_LE(rel_l2_increment(dsrc[size_t(i)], dsrc0[size_t(i)], dsrcd[size_t(i)]), kTol)
          << "dsources[" << i << "], " << ctx;
    }
    const auto dq = download(gdq);
    if (S == 1) {
      // One source: α = 1 and ds = 0 exactly, so dq must not move.
      EXPECT_TRUE(same_bits(dq, dq0)) << "dquery moved with one source, " << ctx;
    } else {
      EXPECT_LE(rel_l2_increment(dq, dq0, dq_ref), kTol) << "dquery, " << ctx;
    }

    // Again, without the query gradient and without source 0's: source 1.. must get the same bits
    // (dq is its own pass), source 0 must stay put; and dq again from its start: the same bits.
    std::vector<kc::DeviceBuffer<float>> gdsrc2;
    for (int i = 0; i < S; ++i) gdsrc2.emplace_back(dsrc0[size_t(i)].data(), dsrc0[size_t(i)].size());
    for (int i = 0; i < S; ++i) bp.dsources[i] = i == 0 ? nullptr : gdsrc2[size_t(i)].data();
    bp.dquery = nullptr, bp.workspace = nullptr;
    ar::attnres_backward_train(bp);
    kc::DeviceBuffer<float> gdq2(dq0.data(), dq0.size());
    for (int i = 0; i < S; ++i) bp.dsources[i] = nullptr;
    bp.dquery = gdq2.data(), bp.workspace = ws.data();
    ar::attnres_backward_train(bp);
    kc::synchronize();
    EXPECT_TRUE(same_bits(download(gdsrc2[0]), dsrc0[0])) << "null dsources[0] was written, " << ctx;
    for (int i = 1; i < S; ++i)
      EXPECT_TRUE(same_bits(download(gdsrc2[size_t(i)]), dsrc[size_t(i)])) << "dsources[" << i << "] differs, " << ctx;
    EXPECT_TRUE(same_bits(download(gdq2), dq)) << "dquery not reproducible, " << ctx;
  }
}

TEST(CudaTrainOps, AttnResQueryFold) {
  K3_REQUIRE_GPU();
  namespace ar = k3::attnres::cuda;
  for (int64_t D : {int64_t(72), int64_t(7168), int64_t(1)}) {
    const auto a = randf(D, 700 + uint64_t(D)), b = randf(D, 701 + uint64_t(D)), dq = randf(D, 702 + uint64_t(D));
    const auto da0 = randf(D, 703 + uint64_t(D)), db0 = randf(D, 704 + uint64_t(D));
    std::vector<double> q_ref(static_cast<size_t>(D)), da_ref = to_double(da0), db_ref = to_double(db0);
    for (size_t d = 0; d < size_t(D); ++d) {
      q_ref[d] = double(a[d]) * b[d];
      da_ref[d] += double(dq[d]) * b[d];
      db_ref[d] += double(dq[d]) * a[d];
    }
    kc::DeviceBuffer<float> ga(a.data(), a.size()), gb(b.data(), b.size()), gdq(dq.data(), dq.size()),
        gq(static_cast<size_t>(D));
    kc::DeviceBuffer<float> gda(da0.data(), da0.size()), gdb(db0.data(), db0.size());
    ar::attnres_query_forward(gq.data(), ga.data(), gb.data(), D);
    ar::attnres_query_backward(gda.data(), gdb.data(), gdq.data(), ga.data(), gb.data(), D);
    kc::synchronize();
    EXPECT_LE(rel_l2(download(gq), q_ref), kTol) << "q, D=" << D;
    EXPECT_LE(rel_l2_increment(download(gda), da0, da_ref), kTol) << "da, D=" << D;
    EXPECT_LE(rel_l2_increment(download(gdb), db0, db_ref), kTol) << "db, D=" << D;
  }
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(CudaTrainOps, EmbeddingRunsHost) {
  namespace em = k3::embed::cuda;
  const auto r = em::make_embedding_runs({5, 3, 5, 0, 3, 5, 7});
  EXPECT_EQ(r.order, (std::vector<int32_t>{3, 1, 4, 0, 2, 5, 6}));
  EXPECT_EQ(r.run_start, (std::vector<int32_t>{0, 1, 3, 6, 7}));
  EXPECT_EQ(r.run_id, (std::vector<int32_t>{0, 3, 5, 7}));
  const auto e = em::make_embedding_runs({});
  EXPECT_TRUE(e.order.empty() && e.run_id.empty());
  EXPECT_EQ(e.run_start, (std::vector<int32_t>{0}));
  const auto one = em::make_embedding_runs({9, 9, 9});
  EXPECT_EQ(one.order, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(one.run_start, (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(one.run_id, (std::vector<int32_t>{9}));
  EXPECT_THROW(em::make_embedding_runs({1, -1, 2}), k3::Error);
}

TEST(CudaTrainOps, EmbeddingMatchesCpu) {
  K3_REQUIRE_GPU();
  namespace em = k3::embed::cuda;
  const int64_t V = 1000;
  struct Case {
    int64_t N, D;
  };
  for (const Case c : {Case{37, 72}, Case{37, 130}, Case{37, 7168}, Case{1000, 72}}) {
    const int64_t N = c.N, D = c.D;
    const std::string ctx = "N=" + std::to_string(N) + " D=" + std::to_string(D);
    std::vector<int32_t> ids(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) ids[size_t(n)] = int32_t((n * n * 7 + 3) % 13);  // many repeats
    ids[0] = 0, ids[1] = int32_t(V - 1), ids[size_t(N - 1)] = int32_t(V - 1);
    if (N >= 1000)
      for (int64_t n = 0; n < N; n += 2) ids[size_t(n)] = 5;  // one long run
    const auto table = randf(V * D, uint64_t(N + D));
    const auto dx = randf(N * D, uint64_t(N + D) + 1);
    const auto dt0 = randf(V * D, uint64_t(N + D) + 2);

    // Truth: the trainer's loop in double; and the kernel's own order (double sum of the run in
    // position order from 0, added once), which it must match bit for bit.
    std::vector<double> dt_ref = to_double(dt0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < D; ++d) dt_ref[size_t(ids[size_t(n)] * D + d)] += dx[size_t(n * D + d)];
    const auto runs = em::make_embedding_runs(ids);
    std::vector<float> dt_exact = dt0;
    for (size_t r = 0; r < runs.run_id.size(); ++r)
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0.0;
        for (int32_t i = runs.run_start[r]; i < runs.run_start[r + 1]; ++i)
          acc += double(dx[size_t(int64_t(runs.order[size_t(i)]) * D + d)]);
        float& t = dt_exact[size_t(int64_t(runs.run_id[r]) * D + d)];
        t = float(double(t) + acc);
      }

    kc::DeviceBuffer<float> gtable(table.data(), table.size()), gx(size_t(N * D)), gdx(dx.data(), dx.size()),
        gdt(dt0.data(), dt0.size());
    kc::DeviceBuffer<int32_t> gids(ids.data(), ids.size()), gorder(runs.order.data(), runs.order.size()),
        gstart(runs.run_start.data(), runs.run_start.size()), grid(runs.run_id.data(), runs.run_id.size());
    em::embedding_forward(gx.data(), gtable.data(), gids.data(), N, D);
    em::embedding_backward(gdt.data(), gdx.data(), gorder.data(), gstart.data(), grid.data(),
                           int64_t(runs.run_id.size()), D);
    kc::synchronize();

    const auto x = download(gx);
    for (int64_t n = 0; n < N; ++n)
      ASSERT_EQ(std::memcmp(&x[size_t(n * D)], &table[size_t(ids[size_t(n)] * D)], size_t(D) * 4), 0)
          << "row " << n << ", " << ctx;
    const auto dt = download(gdt);
    EXPECT_LE(rel_l2_increment(dt, dt0, dt_ref), kTol) << "dtable, " << ctx;
    EXPECT_TRUE(same_bits(dt, dt_exact)) << "dtable not the run sums in position order, " << ctx;
  }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

struct CeResult {
  double loss = 0.0;
  std::vector<float> lse, dlogits;  // [N], [N, V]
  std::string bad;
};

// The chunked protocol end to end with chunks of width W (the last one narrower), each held in an
// [N, W + 5] buffer whose padding columns hold the sentinel.
CeResult run_chunked_ce(const std::vector<float>& logits, const std::vector<int32_t>& target, int64_t N, int64_t V,
                        int64_t W, float scale) {
  namespace lc = k3::loss::cuda;
  const int64_t ld = W + 5;
  kc::DeviceBuffer<float> rmax(static_cast<size_t>(N)), rsum(static_cast<size_t>(N)), tlog(static_cast<size_t>(N)),
      lse(static_cast<size_t>(N)), chunk(size_t(N * ld));
  kc::DeviceBuffer<int32_t> gt(target.data(), target.size());
  kc::DeviceBuffer<double> loss(1);
  kc::DeviceBuffer<uint8_t> ws(std::max<size_t>(1, lc::ce_finish_workspace_bytes(N)));
  auto load_chunk = [&](int64_t v0, int64_t Vc) {
    std::vector<float> h(size_t(N * ld), kSentinel);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Vc; ++j) h[size_t(n * ld + j)] = logits[size_t(n * V + v0 + j)];
    chunk.upload(h.data(), h.size());
  };
  lc::ce_init(rmax.data(), rsum.data(), tlog.data(), N);
  for (int64_t v0 = 0; v0 < V; v0 += W) {
    const int64_t Vc = std::min(W, V - v0);
    load_chunk(v0, Vc);
    lc::ce_chunk_update(rmax.data(), rsum.data(), tlog.data(), chunk.data(), ld, gt.data(), N, v0, Vc);
  }
  lc::ce_finish(lse.data(), loss.data(), rmax.data(), rsum.data(), tlog.data(), gt.data(), N, ws.data());
  CeResult r;
  r.dlogits.assign(size_t(N * V), 0.0f);
  for (int64_t v0 = 0; v0 < V; v0 += W) {
    const int64_t Vc = std::min(W, V - v0);
    load_chunk(v0, Vc);
    lc::ce_chunk_grad(chunk.data(), ld, lse.data(), gt.data(), scale, N, v0, Vc);
    const auto h = download(chunk);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < Vc; ++j) r.dlogits[size_t(n * V + v0 + j)] = h[size_t(n * ld + j)];
      for (int64_t j = Vc; j < ld; ++j)
        if (h[size_t(n * ld + j)] != kSentinel) r.bad = "padding overwritten at row " + std::to_string(n);
    }
  }
  kc::synchronize();
  loss.download(&r.loss, 1);
  r.lse = download(lse);
  return r;
}

TEST(CudaTrainOps, CrossEntropyChunkedMatchesCpu) {
  K3_REQUIRE_GPU();
  const int64_t N = 41, V = 1000;
  auto logits = randf(N * V, 4242, 3.0);
  std::vector<int32_t> target(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) target[size_t(n)] = int32_t((n * 389 + 17) % V);
  target[0] = 0, target[1] = int32_t(V - 1);  // the first and last column
  target[5] = -1, target[6] = -1;             // no prediction (6 with large logits too)
  // Large logits: rows 3, 4, 6 spread over ±80; row 7 predicts its target confidently (loss ~ 0).
  for (int64_t n : {int64_t(3), int64_t(4), int64_t(6)})
    for (int64_t v = 0; v < V; ++v) {
      float& l = logits[size_t(n * V + v)];
      l = std::max(-80.0f, std::min(80.0f, l * 15.0f));
    }
  logits[size_t(3 * V + 500)] = 80.0f, logits[size_t(4 * V + 999)] = -80.0f;
  logits[size_t(4 * V + target[4])] = 79.0f;
  for (int64_t v = 0; v < V; ++v) logits[size_t(7 * V + v)] = -80.0f + 0.01f * float(v % 7);
  logits[size_t(7 * V + target[7])] = 80.0f;
  const float scale = 1.0f / 39.0f;

  // Truth, with the lse in double as the reference computes it.
  const auto ld = to_double(logits);
  std::vector<double> dl_ref(size_t(N * V)), lse_ref(static_cast<size_t>(N));
  const double loss_ref = k3::cross_entropy(ld.data(), target.data(), N, V, dl_ref.data(), double(scale));
  for (int64_t n = 0; n < N; ++n) {
    const double* l = ld.data() + n * V;
    const double mx = *std::max_element(l, l + V);
    double z = 0.0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(l[v] - mx);
    lse_ref[size_t(n)] = mx + std::log(z);
  }

  for (int64_t W : {V, int64_t(256), int64_t(333), int64_t(999), int64_t(7)}) {
    const CeResult r = run_chunked_ce(logits, target, N, V, W, scale);
    const std::string ctx = "chunk width " + std::to_string(W);
    ASSERT_TRUE(r.bad.empty()) << r.bad << ", " << ctx;
    ASSERT_TRUE(std::isfinite(r.loss)) << ctx;
    EXPECT_LE(std::fabs(r.loss - loss_ref) / std::fabs(loss_ref), kTol)
        << "loss " << r.loss << " vs " << loss_ref << ", " << ctx;
    EXPECT_LE(rel_l2(r.lse, lse_ref), kTol) << "lse, " << ctx;
    EXPECT_LE(rel_l2(r.dlogits, dl_ref), kTol) << "dlogits, " << ctx;
    for (int64_t n : {int64_t(5), int64_t(6)})
      for (int64_t v = 0; v < V; ++v)
        ASSERT_EQ(r.dlogits[size_t(n * V + v)], 0.0f) << "row " << n << " has no target, " << ctx;
    // Row 7 predicts its target with a margin of 160: its gradient is ~0 (e^-160), not noise of
    // lse's rounding at 80.
    for (int64_t v = 0; v < V; ++v) ASSERT_LE(std::fabs(r.dlogits[size_t(7 * V + v)]), 1e-6f) << ctx;

    const CeResult again = run_chunked_ce(logits, target, N, V, W, scale);
    EXPECT_EQ(std::memcmp(&again.loss, &r.loss, sizeof(double)), 0) << "loss not reproducible, " << ctx;
    EXPECT_TRUE(same_bits(again.dlogits, r.dlogits)) << "dlogits not reproducible, " << ctx;
  }
}

TEST(CudaTrainOps, CrossEntropyNoRows) {
  K3_REQUIRE_GPU();
  namespace lc = k3::loss::cuda;
  const double start = 123.0;
  kc::DeviceBuffer<double> loss(&start, 1);
  lc::ce_finish(nullptr, loss.data(), nullptr, nullptr, nullptr, nullptr, 0, nullptr);
  double got = -1.0;
  kc::synchronize();
  loss.download(&got, 1);
  EXPECT_EQ(got, 0.0);
}

// ---------------------------------------------------------------------------------------------
// Argument checks: they throw k3::Error before anything is launched, so they run without a GPU.

TEST(CudaTrainOps, BadArgumentsThrow) {
  namespace nc = k3::norm::cuda;
  namespace ar = k3::attnres::cuda;
  namespace em = k3::embed::cuda;
  namespace lc = k3::loss::cuda;
  float* fake = reinterpret_cast<float*>(uintptr_t(256));  // never dereferenced: the checks fail first
  EXPECT_THROW(nc::rmsnorm_forward_train(fake, 8, fake, fake, 16, nullptr, 1e-5f, 4, 16), k3::Error);  // ldy < D
  EXPECT_THROW(nc::rmsnorm_forward_train(fake, 16, fake, fake, 16, nullptr, 1e-5f, -1, 16), k3::Error);
  EXPECT_THROW(nc::rmsnorm_backward_train(fake, 16, fake, fake, 16, fake, 16, fake, nullptr, 4, 16, nullptr),
               k3::Error);  // dw without workspace
  ar::AttnResTrainParams p;
  p.S = 0, p.N = 4, p.D = 8;
  EXPECT_THROW(ar::attnres_forward_train(p), k3::Error);
  p.S = ar::kMaxSources + 1;
  EXPECT_THROW(ar::attnres_forward_train(p), k3::Error);
  p.S = 2, p.sources[0] = fake;  // sources[1] null
  p.query = fake;
  EXPECT_THROW(ar::attnres_forward_train(p), k3::Error);
  ar::AttnResBackwardParams b;
  b.S = 1, b.N = 4, b.D = 8, b.sources[0] = fake, b.query = fake, b.alpha = fake, b.rinv = fake, b.dh = fake;
  b.dquery = fake;  // without a workspace
  EXPECT_THROW(ar::attnres_backward_train(b), k3::Error);
  EXPECT_THROW(em::embedding_backward(fake, fake, nullptr, nullptr, nullptr, -1, 8), k3::Error);
  EXPECT_THROW(em::embedding_forward(fake, nullptr, nullptr, 3, 8), k3::Error);
  EXPECT_THROW(lc::ce_chunk_update(fake, fake, fake, fake, 10, nullptr, 4, 0, 11), k3::Error);  // ld < Vc
  EXPECT_THROW(lc::ce_chunk_grad(fake, 10, fake, nullptr, 1.0f, 4, -1, 5), k3::Error);          // v0 < 0
  EXPECT_THROW(lc::ce_finish(fake, nullptr, fake, fake, fake, nullptr, 4, fake), k3::Error);    // null loss_sum
}

}  // namespace

#else  // no CUDA backend in this build: nothing to link against

TEST(CudaTrainOps, NeedsTheCudaBackend) { GTEST_SKIP() << "this build has no CUDA backend"; }

#endif
