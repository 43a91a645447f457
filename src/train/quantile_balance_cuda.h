// Router-bias balancing on the GPU: the CUDA twin of train/quantile_balance.h's QuantileBalancer (Quantile
// Balancing by the exact or histogram estimator, the EMA option, DeepSeek's sign rule, none), for the
// GPU trainer: the step's router scores stay on the device and so do the bias, the loads and MaxVio.
// The method and every formula are the CPU's (read quantile_balance.h); what is GPU-specific:
//
// * Ranking: token i's biased scores are double(s_ij) + b_j with the bias in double, exactly the CPU's
//   arithmetic, and ties go to the lower expert index; so the loads, the cutoffs α_i and the required
//   biases r_ij = α_i − s_ij are bit for bit the CPU's (given the same fp32 scores). The model's fp32
//   router adds the fp32 bias_device() in fp32; it can disagree with this ranking only where two
//   biased scores are within fp32 rounding of each other.
// * Exact estimator: r is kept per expert ([E, m], doubles; the buffer grows by doubling, so after the
//   first steps no allocation happens; it and the sort's output take 2·E·cap doubles) and sorted per
//   expert with cub::DeviceSegmentedSort at the end of the step; b̂_j is read at the ranks ⌊q⌋+1 and
//   ⌊q⌋+2 with the CPU's linear interpolation.
// * Histogram: integer counts [E, B] by atomic increments (integer adds: deterministic), the grid and
//   the read-off the CPU's, in double.
// * The bias update (EMA, centring, the sign rule) in double on the device, as on the CPU, except that
//   the centring's sums are compensated double sums where the CPU uses long double: the result can
//   differ in the last bit.
// * No host synchronisation in accumulate() or finish_step(); last_max_vio() and to_json() copy to
//   the host. Device pointers; the default stream.
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cuda.h"
#include "train/quantile_balance.h"

namespace k3::train {

class CudaQuantileBalancer {
 public:
  // As QuantileBalancer (same checks): initial_bias [E] or empty (zeros); 1 <= top_k < num_experts,
  // and top_k <= kMaxTopK (the per-token selection keeps k + 1 candidates in registers).
  static constexpr int64_t kMaxTopK = 63;
  CudaQuantileBalancer(int64_t num_experts, int64_t top_k, BalanceOptions opt, const std::vector<double>& initial_bias);
  CudaQuantileBalancer(CudaQuantileBalancer&&) = default;
  CudaQuantileBalancer& operator=(CudaQuantileBalancer&&) = default;

  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return K_; }
  const BalanceOptions& options() const { return opt_; }
  int64_t steps() const { return steps_; }
  int64_t pending_tokens() const { return tokens_; }

  // [E] fp32: the bias that routes the current step (the model's router reads it).
  const float* bias_device() const { return bias_f_.data(); }
  // The same bias in double, copied to the host (tests, logs).
  std::vector<double> bias() const;

  // One forward pass of the current step: device scores [N, E] (the unbiased sigmoid router scores).
  void accumulate(const float* scores, int64_t N);
  // Ends the step: its loads and MaxVio (kept on the device), the next bias by the chosen method (on
  // the device), the accumulators cleared. An empty step leaves the bias unchanged.
  void finish_step();
  // The last finished step's MaxVio (one small device-to-host copy) and loads [E].
  double last_max_vio() const;
  std::vector<int64_t> last_loads() const;

  // The CPU QuantileBalancer's checkpoint format (so checkpoints interoperate); between steps only.
  nlohmann::json to_json() const;
  static CudaQuantileBalancer from_json(const nlohmann::json& j);

 private:
  void reserve_tokens(int64_t m);  // the exact estimator's r buffers hold at least m tokens
  void estimate_exact();           // b̂ of the pending step into bhat_
  void estimate_histogram();

  int64_t E_, K_;
  BalanceOptions opt_;
  int64_t steps_ = 0;
  int64_t tokens_ = 0;                              // pending step
  cuda::DeviceBuffer<double> bias_;                 // [E]
  cuda::DeviceBuffer<float> bias_f_;                // [E] the routing copy
  cuda::DeviceBuffer<double> bhat_;                 // [E] the QB target before EMA and centring
  cuda::DeviceBuffer<int64_t> loads_, last_loads_;  // [E]
  cuda::DeviceBuffer<double> last_max_vio_;         // [1]
  // Exact: r_ij for expert j at r_[j·cap + i] (cap tokens per expert), and the sort's output / input.
  int64_t cap_ = 0;
  cuda::DeviceBuffer<double> r_, sorted_;
  cuda::DeviceBuffer<int64_t> seg_offsets_;  // [E + 1] j·m
  cuda::DeviceBuffer<uint8_t> sort_temp_;
  // Histogram: counts [E, B] and the step's grid (lo, w) computed from the bias in effect.
  cuda::DeviceBuffer<int64_t> hist_;
  cuda::DeviceBuffer<double> grid_;  // [2]
};

}  // namespace k3::train
