// The one-launch grouped expert GEMMs of training (kernels/moe/expert_gemm_train_cuda.h) against
//   - a float64 CPU product of the same bf16 values (the truth: the kernels differ from it only by fp32
//     accumulation), relative L2 <= 1e-5 for forward, backward-data and backward-weight, with and
//     without accumulate;
//   - the per-expert cuBLAS loop experts_linear_* (moe_train_cuda.h) with DType::BF16, relative L2
//     <= 1e-5 between the two;
// The 1e-5 bound vs float64: bf16 products are exact, so only the fp32 accumulation differs. Modelling
// the tensor cores' adds as rounding toward zero (each k16 step truncates the accumulator) a CPU
// simulation on N(0, 1) data gives relative L2 ~2.5e-7 at k = 256, 3.8e-6 at 3072 and 4.5e-6 at 3584 (the
// largest k here), so the bound holds with ~2x margin; round-to-nearest would give ~6e-7.
// It also checks that results are bitwise the same run to run, that every output row is written (outputs
// start as NaN), that experts with no rows keep their dW bit for bit, and that bad shapes throw.
// Shapes: E = 5 experts of {0, 1, 17, 64, 130} rows at (out, in) = (24, 40), (256, 256) and (136, 264)
// (partial tiles both ways); E = 4 of {0, 1, 17, 45} rows at (3072, 3584) and (3584, 3072), K3's sizes; E = 192 top-4 routing of 3000 tokens (random
// counts) at k3-1b's (256, 256). The sorted rows come from TrainDispatch (the layout the kernels serve).
// Skips without a Hopper GPU (K3_REQUIRE_GPU), except the argument checks, which throw before any GPU work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "util/compare.h"
#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/moe/expert_gemm_train_cuda.h"
#include "kernels/moe/moe_train_cuda.h"

namespace {

namespace mc = k3::moe::cuda;
namespace gc = k3::gemm::cuda;
using k3::DType;
using k3::cuda::DeviceBuffer;
using k3test::rel_l2;

constexpr double kTol = 1e-5;

template <class T>
DeviceBuffer<T> to_device(const std::vector<T>& h) {
  return DeviceBuffer<T>(h.data(), h.size());
}
template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d) {
  std::vector<T> h(d.size());
  d.download(h.data(), h.size());
  return h;
}

// n bf16 values of N(0, 1) (as bit patterns) and their exact widening.
void random_bf16(std::mt19937_64& rng, size_t n, std::vector<uint16_t>* bits, std::vector<double>* val) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  bits->resize(n);
  val->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*bits)[i] = k3::f32_to_bf16(nd(rng));
    (*val)[i] = double(k3::bf16_to_f32((*bits)[i]));
  }
}
std::vector<float> random_f32(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// One routing: idx [N, K] for TrainDispatch. `counts` given: K = 1, token n of expert e in a shuffled
// order (so the sort is exercised). Otherwise top-K of E distinct experts per token, at random.
struct Routing {
  int64_t N, E, K;
  std::vector<int32_t> idx;
};
Routing routing_from_counts(const std::vector<int64_t>& counts, std::mt19937_64& rng) {
  Routing r{0, int64_t(counts.size()), 1, {}};
  for (size_t e = 0; e < counts.size(); ++e)
    for (int64_t i = 0; i < counts[e]; ++i) r.idx.push_back(int32_t(e));
  std::shuffle(r.idx.begin(), r.idx.end(), rng);
  r.N = int64_t(r.idx.size());
  return r;
}
Routing routing_topk(int64_t N, int64_t E, int64_t K, std::mt19937_64& rng) {
  Routing r{N, E, K, {}};
  // Skewed expert popularity, so the counts vary widely (some experts may get none).
  std::vector<double> wgt(static_cast<size_t>(E));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (double& w : wgt) w = std::pow(u(rng), 3.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> pick;
    while (int64_t(pick.size()) < K) {
      std::discrete_distribution<int32_t> d(wgt.begin(), wgt.end());
      const int32_t e = d(rng);
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    r.idx.insert(r.idx.end(), pick.begin(), pick.end());
  }
  return r;
}

void gemm_case(const std::string& name, const Routing& rt, int64_t out, int64_t in, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t E = rt.E, S = rt.N * rt.K;

  K3_REQUIRE_GPU();
  mc::TrainDispatch d(std::max<int64_t>(rt.N, 1), E, rt.K);
  DeviceBuffer<int32_t> idx_d = to_device(rt.idx);
  d.build(idx_d.data(), rt.N);
  const std::vector<int64_t>& off = d.offsets();
  ASSERT_EQ(off.back(), S) << name;

  // Operands on the sorted rows: x [S, in], dy [S, out], W [E, out, in] (bf16), their f64 values.
  std::vector<uint16_t> xb, dyb, wb;
  std::vector<double> x, dy, w;
  random_bf16(rng, size_t(S * in), &xb, &x);
  random_bf16(rng, size_t(S * out), &dyb, &dy);
  random_bf16(rng, size_t(E * out * in), &wb, &w);
  const std::vector<float> y0 = random_f32(rng, size_t(S * out)), dx0 = random_f32(rng, size_t(S * in)),
                           dw0 = random_f32(rng, size_t(E * out * in));

  // f64 truth: the products, then the accumulate variants add the fp32 start values.
  std::vector<double> y(size_t(S * out), 0.0), dx(size_t(S * in), 0.0), dw(size_t(E * out * in), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    const double* We = w.data() + e * out * in;
    for (int64_t r = off[size_t(e)]; r < off[size_t(e + 1)]; ++r) {
      const double* xr = x.data() + r * in;
      const double* dyr = dy.data() + r * out;
      for (int64_t n = 0; n < out; ++n) {
        double s = 0.0;
        for (int64_t k = 0; k < in; ++k) s += xr[k] * We[n * in + k];
        y[size_t(r * out + n)] = s;
      }
      double* dxr = dx.data() + r * in;
      for (int64_t k = 0; k < out; ++k)
        for (int64_t n = 0; n < in; ++n) dxr[n] += dyr[k] * We[k * in + n];
      double* dWe = dw.data() + e * out * in;
      for (int64_t m = 0; m < out; ++m)
        for (int64_t n = 0; n < in; ++n) dWe[m * in + n] += dyr[m] * xr[n];
    }
  }
  std::vector<double> y_acc(y), dx_acc(dx), dw_acc(dw);
  for (size_t i = 0; i < y.size(); ++i) y_acc[i] += y0[i];
  for (size_t i = 0; i < dx.size(); ++i) dx_acc[i] += dx0[i];
  for (size_t i = 0; i < dw.size(); ++i) dw_acc[i] += dw0[i];

  DeviceBuffer<uint16_t> xd = to_device(xb), dyd = to_device(dyb), wd = to_device(wb);
  DeviceBuffer<unsigned char> ws(mc::grouped_linear_workspace_bytes(E));
  const int32_t* offs = d.offsets_device();
  const std::vector<float> nan_y(size_t(S * out), NAN), nan_dx(size_t(S * in), NAN);

  // ---- forward: overwrite (twice, bitwise equal) and accumulate
  std::vector<float> fwd[2];
  for (int rep = 0; rep < 2; ++rep) {
    DeviceBuffer<float> yd = to_device(nan_y);
    mc::grouped_linear_forward_bf16(yd.data(), xd.data(), wd.data(), offs, S, E, out, in, false, ws.data());
    fwd[rep] = to_host(yd);
  }
  EXPECT_LE(rel_l2(y, fwd[0]), kTol) << name << ": forward";
  EXPECT_TRUE(bitwise_equal(fwd[0], fwd[1])) << name << ": forward not deterministic";
  {
    DeviceBuffer<float> yd = to_device(y0);
    mc::grouped_linear_forward_bf16(yd.data(), xd.data(), wd.data(), offs, S, E, out, in, true, ws.data());
    EXPECT_LE(rel_l2(y_acc, to_host(yd)), kTol) << name << ": forward accumulate";
  }

  // ---- backward data
  std::vector<float> bwd[2];
  for (int rep = 0; rep < 2; ++rep) {
    DeviceBuffer<float> dxd = to_device(nan_dx);
    mc::grouped_linear_backward_data_bf16(dxd.data(), dyd.data(), wd.data(), offs, S, E, out, in, false, ws.data());
    bwd[rep] = to_host(dxd);
  }
  EXPECT_LE(rel_l2(dx, bwd[0]), kTol) << name << ": backward data";
  EXPECT_TRUE(bitwise_equal(bwd[0], bwd[1])) << name << ": backward data not deterministic";
  {
    DeviceBuffer<float> dxd = to_device(dx0);
    mc::grouped_linear_backward_data_bf16(dxd.data(), dyd.data(), wd.data(), offs, S, E, out, in, true, ws.data());
    EXPECT_LE(rel_l2(dx_acc, to_host(dxd)), kTol) << name << ": backward data accumulate";
  }

  // ---- backward weight (always accumulates): from dw0, twice from the same start
  std::vector<float> wgt[2];
  for (int rep = 0; rep < 2; ++rep) {
    DeviceBuffer<float> dwd = to_device(dw0);
    mc::grouped_linear_backward_weight_bf16(dwd.data(), dyd.data(), xd.data(), offs, S, E, out, in);
    wgt[rep] = to_host(dwd);
  }
  EXPECT_LE(rel_l2(dw_acc, wgt[0]), kTol) << name << ": backward weight";
  EXPECT_TRUE(bitwise_equal(wgt[0], wgt[1])) << name << ": backward weight not deterministic";
  for (int64_t e = 0; e < E; ++e) {
    if (off[size_t(e + 1)] > off[size_t(e)]) continue;
    const size_t b = size_t(e * out * in), n = size_t(out * in);
    EXPECT_EQ(0, std::memcmp(wgt[0].data() + b, dw0.data() + b, n * sizeof(float)))
        << name << ": expert " << e << " has no rows but its dW changed";
  }

  // ---- the per-expert cuBLAS loop on the same bf16 operands
  gc::GemmContext ctx;
  {
    DeviceBuffer<float> yd = to_device(nan_y);
    mc::experts_linear_forward(ctx, yd.data(), xd.data(), wd.data(), DType::BF16, d, out, in);
    EXPECT_LE(rel_l2(fwd[0], to_host(yd)), kTol) << name << ": forward vs experts_linear_forward";
  }
  {
    DeviceBuffer<float> dxd = to_device(dx0);
    mc::experts_linear_backward_data(ctx, dxd.data(), dyd.data(), wd.data(), DType::BF16, d, out, in, true);
    DeviceBuffer<float> dxg = to_device(dx0);
    mc::grouped_linear_backward_data_bf16(dxg.data(), dyd.data(), wd.data(), offs, S, E, out, in, true, ws.data());
    EXPECT_LE(rel_l2(to_host(dxg), to_host(dxd)), kTol) << name << ": backward data vs experts_linear_backward_data";
  }
  {
    DeviceBuffer<float> dwd = to_device(dw0);
    mc::experts_linear_backward_weight(ctx, dwd.data(), dyd.data(), xd.data(), DType::BF16, d, out, in);
    EXPECT_LE(rel_l2(wgt[0], to_host(dwd)), kTol) << name << ": backward weight vs experts_linear_backward_weight";
  }
}

TEST(CudaTrainExpertGemm, FiveExpertsSmall) {
  std::mt19937_64 rng(1);
  gemm_case("E5 24x40", routing_from_counts({0, 1, 17, 64, 130}, rng), 24, 40, 11);
}

TEST(CudaTrainExpertGemm, FiveExpertsSquare) {
  std::mt19937_64 rng(2);
  gemm_case("E5 256x256", routing_from_counts({0, 1, 17, 64, 130}, rng), 256, 256, 12);
  gemm_case("E5 136x264", routing_from_counts({130, 0, 1, 64, 17}, rng), 136, 264, 13);  // partial tiles
}

TEST(CudaTrainExpertGemm, K3ExpertShapeFewRows) {
  std::mt19937_64 rng(3);
  gemm_case("E4 3072x3584", routing_from_counts({0, 1, 17, 45}, rng), 3072, 3584, 14);
  gemm_case("E4 3584x3072", routing_from_counts({45, 17, 0, 1}, rng), 3584, 3072, 15);
}

TEST(CudaTrainExpertGemm, K3OneBRouting) {
  std::mt19937_64 rng(4);
  gemm_case("E192 top4 N3000 256x256", routing_topk(3000, 192, 4, rng), 256, 256, 16);
}

TEST(CudaTrainExpertGemm, EmptyBatchDoesNothing) {
  K3_REQUIRE_GPU();
  const int64_t E = 3, out = 16, in = 8;
  DeviceBuffer<int32_t> offs(std::vector<int32_t>(E + 1, 0).data(), size_t(E + 1));
  DeviceBuffer<uint16_t> a(64), b(size_t(E * out * in));
  const std::vector<float> start = {1.5f, -2.0f, 3.25f};
  DeviceBuffer<float> c(start.data(), start.size()),
      dw(std::vector<float>(size_t(E * out * in), 7.0f).data(), size_t(E * out * in));
  DeviceBuffer<unsigned char> ws(mc::grouped_linear_workspace_bytes(E));
  mc::grouped_linear_forward_bf16(c.data(), a.data(), b.data(), offs.data(), 0, E, out, in, false, ws.data());
  mc::grouped_linear_backward_data_bf16(c.data(), a.data(), b.data(), offs.data(), 0, E, out, in, false, ws.data());
  mc::grouped_linear_backward_weight_bf16(dw.data(), a.data(), a.data(), offs.data(), 0, E, out, in);
  EXPECT_EQ(to_host(c), start);
  EXPECT_EQ(to_host(dw), std::vector<float>(size_t(E * out * in), 7.0f));
}

// Argument checks run on the host before any GPU work: no GPU needed (the pointers are never read).
TEST(CudaTrainExpertGemm, RejectsBadArguments) {
  alignas(16) static uint16_t bf[64];
  alignas(16) static float f[64];
  alignas(16) static int32_t offs[8];
  alignas(16) static unsigned char ws[64];
  auto expect_throw = [](const std::function<void()>& fn, const std::string& what) {
    try {
      fn();
      ADD_FAILURE() << "expected k3::Error mentioning '" << what << "'";
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_throw([&] { mc::grouped_linear_forward_bf16(f, bf, bf, offs, 4, 2, 20, 16, false, ws); },
               "out must be a positive multiple of 8");
  expect_throw([&] { mc::grouped_linear_backward_data_bf16(f, bf, bf, offs, 4, 2, 16, 12, false, ws); },
               "in must be a positive multiple of 8");
  expect_throw([&] { mc::grouped_linear_backward_weight_bf16(f, bf, bf, offs, 4, 0, 16, 16); }, "E must be");
  expect_throw([&] { mc::grouped_linear_backward_weight_bf16(f, bf + 1, bf, offs, 4, 2, 16, 16); }, "16-byte aligned");
  expect_throw([&] { mc::grouped_linear_forward_bf16(f + 1, bf, bf, offs, 4, 2, 16, 16, false, ws); },
               "8-byte aligned");
  expect_throw([&] { mc::grouped_linear_forward_bf16(f, bf, bf, nullptr, 4, 2, 16, 16, false, ws); },
               "offsets is null");
  expect_throw([&] { mc::grouped_linear_forward_bf16(f, bf, bf, offs, 4, 2, 16, 16, false, nullptr); }, "workspace");
}

}  // namespace

#else

TEST(CudaTrainExpertGemm, NeedsTheCudaBackend) { GTEST_SKIP() << "this build has no CUDA backend"; }

#endif
