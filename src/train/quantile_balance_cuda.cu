// Quantile Balancing, its histogram estimator, the sign rule and MaxVio on the GPU
// (quantile_balance_cuda.h): the twin of train/quantile_balance.cpp, formula for formula.
#include <cub/device/device_segmented_sort.cuh>

#include <algorithm>
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "train/quantile_balance_cuda.h"

namespace k3::train {

namespace {

constexpr int kThreads = 256;
using ull = unsigned long long;

#define K3_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

unsigned grid_for(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  return unsigned(std::clamp<int64_t>(b, 1, 65536));
}

enum RouteMode { kLoadsOnly = 0, kExact = 1, kHistogram = 2 };

// One thread per token: top-(k+1) of double(s_ij) + b_j (ties to the lower expert index, as
// rank_token in quantile_balance.cpp), loads of the first k (integer atomics: order-free), α_i = the
// (k+1)-th biased score; then, by mode, r_ij = α_i − s_ij into r[j·ld_r + i] or its histogram bin.
template <int MODE>
__global__ void route_kernel(const float* __restrict__ scores, int64_t N, int64_t E, int64_t K,
                             const double* __restrict__ bias, ull* __restrict__ loads, double* __restrict__ r,
                             int64_t ld_r, ull* __restrict__ hist, int64_t B, const double* __restrict__ grid) {
  constexpr int kSlots = int(CudaQuantileBalancer::kMaxTopK) + 1;
  K3_GRID_STRIDE(i, N) {
    const float* s = scores + i * E;
    double tv[kSlots];
    int32_t ti[kSlots];
    const int64_t K1 = K + 1;
    int64_t cnt = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double v = double(s[e]) + bias[e];
      int64_t j;
      if (cnt < K1) j = cnt++;
      else if (v > tv[K1 - 1]) j = K1 - 1;  // an equal score keeps the earlier (lower) expert
      else continue;
      while (j > 0 && v > tv[j - 1]) {
        tv[j] = tv[j - 1];
        ti[j] = ti[j - 1];
        --j;
      }
      tv[j] = v;
      ti[j] = int32_t(e);
    }
    for (int64_t k = 0; k < K; ++k) atomicAdd(&loads[ti[k]], ull(1));
    const double alpha = tv[K];
    if constexpr (MODE == kExact) {
      for (int64_t e = 0; e < E; ++e) r[e * ld_r + i] = alpha - double(s[e]);
    } else if constexpr (MODE == kHistogram) {
      const double lo = grid[0], w = grid[1];
      for (int64_t e = 0; e < E; ++e) {
        // bin_of: floor((r − lo)/w) clamped to [0, B − 1] (r lies inside mathematically).
        double k = floor((alpha - double(s[e]) - lo) / w);
        k = k < 0.0 ? 0.0 : k > double(B - 1) ? double(B - 1) : k;
        atomicAdd(&hist[e * B + int64_t(k)], ull(1));
      }
    }
  }
}

// The histogram's grid from the bias in effect: lo = b_min − 1, w = (b_max − b_min + 2)/B.
__global__ void grid_kernel(const double* __restrict__ bias, int64_t E, int64_t B, double* __restrict__ grid) {
  double mn = bias[0], mx = bias[0];
  for (int64_t e = 1; e < E; ++e) mn = fmin(mn, bias[e]), mx = fmax(mx, bias[e]);
  grid[0] = mn - 1.0;
  grid[1] = (mx - mn + 2.0) / double(B);
}

// The finished step's loads and MaxVio = (max − mean)/mean (0 when no token was routed).
__global__ void stats_kernel(const int64_t* __restrict__ loads, int64_t E, int64_t* __restrict__ last_loads,
                             double* __restrict__ max_vio) {
  int64_t total = 0, mx = loads[0];
  for (int64_t e = 0; e < E; ++e) {
    total += loads[e];
    mx = loads[e] > mx ? loads[e] : mx;
    last_loads[e] = loads[e];
  }
  if (total == 0) {
    *max_vio = 0.0;
  } else {
    const double mean = double(total) / double(E);
    *max_vio = (double(mx) - mean) / mean;
  }
}

__global__ void offsets_kernel(int64_t* __restrict__ off, int64_t E, int64_t m) {
  K3_GRID_STRIDE(e, E + 1) off[e] = e * m;
}

// Exact b̂_j from expert j's ascending r (sorted[j·m, (j+1)·m)): rank ⌊q⌋+1, or with q = f + t
// fractional (1 − t)·r_(f+1) + t·r_(f+2) (r_(m+1) := r_(m)). Products and sum rounded separately
// (no FMA contraction), as written on the CPU.
__global__ void exact_estimate_kernel(const double* __restrict__ sorted, int64_t E, int64_t m, int64_t K,
                                      double* __restrict__ bhat) {
  K3_GRID_STRIDE(e, E) {
    const int64_t f = (m * K) / E, num = (m * K) % E;
    const double t = double(num) / double(E);
    const double* col = sorted + e * m;
    const double lo = col[f];
    const double hi = num != 0 && f + 1 < m ? col[f + 1] : lo;
    bhat[e] = num == 0 ? lo : __dadd_rn(__dmul_rn(1.0 - t, lo), __dmul_rn(t, hi));
  }
}

// Histogram b̂_j (App. D): the first bin β whose cumulative count reaches ⌈q⌉, c = count before it,
// h = count in it: lo + (β + clip((q − c)/h, 0, 1))·w.
__global__ void histogram_estimate_kernel(const int64_t* __restrict__ hist, int64_t E, int64_t B, int64_t m, int64_t K,
                                          const double* __restrict__ grid, double* __restrict__ bhat) {
  K3_GRID_STRIDE(e, E) {
    const double q = double(m * K) / double(E);
    const int64_t target = (m * K + E - 1) / E;  // ⌈q⌉
    const int64_t* h = hist + e * B;
    int64_t c = 0, beta = 0;
    while (beta < B - 1 && c + h[beta] < target) c += h[beta++];
    double frac = 0.0;
    if (h[beta] > 0) {
      frac = (q - double(c)) / double(h[beta]);
      frac = frac < 0.0 ? 0.0 : frac > 1.0 ? 1.0 : frac;
    }
    bhat[e] = __dadd_rn(grid[0], __dmul_rn(double(beta) + frac, grid[1]));
  }
}

// Σ x in double with Neumaier's compensation (the CPU's centring sums in long double).
__device__ double compensated_sum(const double* x, int64_t n) {
  double s = 0.0, c = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double t = s + x[i];
    c += fabs(s) >= fabs(x[i]) ? (s - t) + x[i] : (x[i] - t) + s;
    s = t;
  }
  return s + c;
}

// QB's new bias: optional EMA with the old bias, centred (two passes, as the CPU), replacing the old.
__global__ void qb_update_kernel(double* __restrict__ bias, float* __restrict__ bias_f, double* __restrict__ bhat,
                                 int64_t E, double ema) {
  if (ema > 0)
    for (int64_t e = 0; e < E; ++e) bhat[e] = __dadd_rn(__dmul_rn(1.0 - ema, bhat[e]), __dmul_rn(ema, bias[e]));
  for (int pass = 0; pass < 2; ++pass) {
    const double mean = compensated_sum(bhat, E) / double(E);
    for (int64_t e = 0; e < E; ++e) bhat[e] -= mean;
  }
  for (int64_t e = 0; e < E; ++e) {
    bias[e] = bhat[e];
    bias_f[e] = float(bhat[e]);
  }
}

// The sign rule: b_j += u·sign(mean load − load_j).
__global__ void sign_kernel(double* __restrict__ bias, float* __restrict__ bias_f, const int64_t* __restrict__ loads,
                            int64_t E, int64_t tokens, int64_t K, double rate) {
  K3_GRID_STRIDE(e, E) {
    const double mean = double(tokens * K) / double(E);
    const double err = mean - double(loads[e]);
    bias[e] += rate * double((err > 0) - (err < 0));
    bias_f[e] = float(bias[e]);
  }
}

}  // namespace

CudaQuantileBalancer::CudaQuantileBalancer(int64_t num_experts, int64_t top_k, BalanceOptions opt,
                                           const std::vector<double>& initial_bias)
    : E_(num_experts), K_(top_k), opt_(opt) {
  const QuantileBalancer check(num_experts, top_k, opt, initial_bias);  // the CPU's argument checks
  if (K_ > kMaxTopK) fail("quantile balancer (cuda): top-k ", K_, " is above the supported ", kMaxTopK);
  const std::vector<double>& b = check.bias();
  const std::vector<float> bf(b.begin(), b.end());
  bias_ = cuda::DeviceBuffer<double>(b.data(), b.size());
  bias_f_ = cuda::DeviceBuffer<float>(bf.data(), bf.size());
  bhat_ = cuda::DeviceBuffer<double>(size_t(E_));
  loads_ = cuda::DeviceBuffer<int64_t>(size_t(E_));
  last_loads_ = cuda::DeviceBuffer<int64_t>(size_t(E_));
  last_max_vio_ = cuda::DeviceBuffer<double>(1);
  if (opt_.method == BalanceMethod::QuantileHistogram) {
    hist_ = cuda::DeviceBuffer<int64_t>(size_t(E_ * opt_.num_bins));
    grid_ = cuda::DeviceBuffer<double>(2);
  }
  if (opt_.method == BalanceMethod::QuantileExact) seg_offsets_ = cuda::DeviceBuffer<int64_t>(size_t(E_ + 1));
}

std::vector<double> CudaQuantileBalancer::bias() const {
  std::vector<double> b(static_cast<size_t>(E_));
  bias_.download(b.data(), b.size());
  return b;
}

void CudaQuantileBalancer::reserve_tokens(int64_t m) {
  if (m <= cap_) return;
  const int64_t cap = std::max({m, 2 * cap_, int64_t(1024)});
  cuda::DeviceBuffer<double> r(size_t(E_ * cap));
  if (tokens_ > 0)  // expert j's pending tokens move from j·cap_ to j·cap
    K3_CUDA_CHECK(cudaMemcpy2DAsync(r.data(), size_t(cap) * sizeof(double), r_.data(), size_t(cap_) * sizeof(double),
                                    size_t(tokens_) * sizeof(double), size_t(E_), cudaMemcpyDeviceToDevice, 0));
  r_ = std::move(r);
  sorted_ = cuda::DeviceBuffer<double>(size_t(E_ * cap));
  cap_ = cap;
}

void CudaQuantileBalancer::accumulate(const float* scores, int64_t N) {
  if (N < 0) fail("quantile balancer: negative token count");
  if (N == 0) return;
  if (!scores) fail("quantile balancer (cuda): null scores");
  const unsigned grid = grid_for(N);
  ull* loads = reinterpret_cast<ull*>(loads_.data());
  switch (opt_.method) {
    case BalanceMethod::QuantileExact:
      reserve_tokens(tokens_ + N);
      route_kernel<kExact>
          <<<grid, kThreads>>>(scores, N, E_, K_, bias_.data(), loads, r_.data() + tokens_, cap_, nullptr, 0, nullptr);
      break;
    case BalanceMethod::QuantileHistogram:
      // The grid comes from the bias in effect, fixed for the whole step: every forward bins alike.
      if (tokens_ == 0) {
        grid_kernel<<<1, 1>>>(bias_.data(), E_, opt_.num_bins, grid_.data());
        K3_CUDA_LAUNCH_CHECK();
      }
      route_kernel<kHistogram><<<grid, kThreads>>>(scores, N, E_, K_, bias_.data(), loads, nullptr, 0,
                                                   reinterpret_cast<ull*>(hist_.data()), opt_.num_bins, grid_.data());
      break;
    case BalanceMethod::None:
    case BalanceMethod::Sign:
      route_kernel<kLoadsOnly>
          <<<grid, kThreads>>>(scores, N, E_, K_, bias_.data(), loads, nullptr, 0, nullptr, 0, nullptr);
      break;
  }
  K3_CUDA_LAUNCH_CHECK();
  tokens_ += N;
}

void CudaQuantileBalancer::estimate_exact() {
  const int64_t m = tokens_;
  // CUB sorts contiguous [E, m] segments: r_ is [E, cap_]; compact it into sorted_ first when cap_ > m.
  const double* in = r_.data();
  double* out = sorted_.data();
  if (cap_ != m) {
    K3_CUDA_CHECK(cudaMemcpy2DAsync(sorted_.data(), size_t(m) * sizeof(double), r_.data(),
                                    size_t(cap_) * sizeof(double), size_t(m) * sizeof(double), size_t(E_),
                                    cudaMemcpyDeviceToDevice, 0));
    in = sorted_.data();
    out = r_.data();
  }
  offsets_kernel<<<grid_for(E_ + 1), kThreads>>>(seg_offsets_.data(), E_, m);
  K3_CUDA_LAUNCH_CHECK();
  const int64_t* off = seg_offsets_.data();
  size_t bytes = 0;
  K3_CUDA_CHECK(cub::DeviceSegmentedSort::SortKeys(nullptr, bytes, in, out, E_ * m, E_, off, off + 1, 0));
  if (bytes > sort_temp_.size()) sort_temp_ = cuda::DeviceBuffer<uint8_t>(std::max<size_t>(bytes, 1));
  K3_CUDA_CHECK(cub::DeviceSegmentedSort::SortKeys(sort_temp_.data(), bytes, in, out, E_ * m, E_, off, off + 1, 0));
  exact_estimate_kernel<<<grid_for(E_), kThreads>>>(out, E_, m, K_, bhat_.data());
  K3_CUDA_LAUNCH_CHECK();
}

void CudaQuantileBalancer::estimate_histogram() {
  histogram_estimate_kernel<<<grid_for(E_), kThreads>>>(hist_.data(), E_, opt_.num_bins, tokens_, K_, grid_.data(),
                                                        bhat_.data());
  K3_CUDA_LAUNCH_CHECK();
}

void CudaQuantileBalancer::finish_step() {
  stats_kernel<<<1, 1>>>(loads_.data(), E_, last_loads_.data(), last_max_vio_.data());
  K3_CUDA_LAUNCH_CHECK();
  if (tokens_ > 0) {
    switch (opt_.method) {
      case BalanceMethod::None: break;
      case BalanceMethod::QuantileExact:
      case BalanceMethod::QuantileHistogram:
        if (opt_.method == BalanceMethod::QuantileExact) estimate_exact();
        else estimate_histogram();
        qb_update_kernel<<<1, 1>>>(bias_.data(), bias_f_.data(), bhat_.data(), E_, opt_.ema_decay);
        K3_CUDA_LAUNCH_CHECK();
        break;
      case BalanceMethod::Sign:
        sign_kernel<<<grid_for(E_), kThreads>>>(bias_.data(), bias_f_.data(), loads_.data(), E_, tokens_, K_,
                                                opt_.sign_rate);
        K3_CUDA_LAUNCH_CHECK();
        break;
    }
  }
  tokens_ = 0;
  cuda::zero_on_device(loads_.data(), size_t(E_) * sizeof(int64_t));
  if (hist_.size() > 0) cuda::zero_on_device(hist_.data(), hist_.size() * sizeof(int64_t));
  ++steps_;
}

double CudaQuantileBalancer::last_max_vio() const {
  double v = 0;
  last_max_vio_.download(&v, 1);
  return v;
}

std::vector<int64_t> CudaQuantileBalancer::last_loads() const {
  std::vector<int64_t> l(static_cast<size_t>(E_));
  last_loads_.download(l.data(), l.size());
  return l;
}

nlohmann::json CudaQuantileBalancer::to_json() const {
  if (tokens_ != 0) fail("quantile balancer: checkpoint in the middle of a step (", tokens_, " tokens pending)");
  // The CPU balancer writes the format; only the step count is not a constructor argument.
  nlohmann::json j = QuantileBalancer(E_, K_, opt_, bias()).to_json();
  j["steps"] = steps_;
  return j;
}

CudaQuantileBalancer CudaQuantileBalancer::from_json(const nlohmann::json& j) {
  const QuantileBalancer c = QuantileBalancer::from_json(j);  // the CPU's parsing and checks
  CudaQuantileBalancer g(c.num_experts(), c.top_k(), c.options(), c.bias());
  g.steps_ = c.steps();
  return g;
}

}  // namespace k3::train
