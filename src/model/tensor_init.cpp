#include "model/tensor_init.h"

#include <cmath>

#include "core/error.h"

namespace k3 {

TensorInitializer::TensorInitializer(const K3Config& c, const RandomInitOptions& opt)
    : std_(c.initializer_range),
      conv_bound_(1.0f / std::sqrt(float(c.short_conv_kernel_size))),
      router_bias_std_(opt.router_bias_std),
      random_queries_(opt.random_attnres_queries),
      mxfp4_(opt.mxfp4_experts),
      rng_(opt.seed) {}

void TensorInitializer::begin(const TensorEntry& e) { begin(e.info().init, e.numel()); }

void TensorInitializer::begin(TensorInit init, int64_t n) {
  K3_ASSERT(left_ == 0 && n >= 0);
  mode_ = init;
  left_ = n;
  // A fresh distribution per tensor: std::normal_distribution keeps the second value of each pair it
  // makes, and the first k3 init dropped it at every tensor boundary.
  normal_ = std::normal_distribution<float>(0.0f, std_);
}

void TensorInitializer::fill(float* out, int64_t n) {
  K3_ASSERT(n >= 0 && n <= left_);
  left_ -= n;
  // Distributions built inside the loop are per element, as the first k3 init did (the uniform ones
  // hold no state, so that changes nothing; the router bias's normal drops its spare value each time).
  switch (mode_) {
    case TensorInit::Normal:
      for (int64_t i = 0; i < n; ++i) out[i] = normal_(rng_);
      return;
    case TensorInit::One:
      for (int64_t i = 0; i < n; ++i) out[i] = 1.0f;
      return;
    case TensorInit::AttnResProj:
      for (int64_t i = 0; i < n; ++i) out[i] = random_queries_ ? normal_(rng_) : 0.0f;
      return;
    case TensorInit::ConvUniform:
      for (int64_t i = 0; i < n; ++i) out[i] = std::uniform_real_distribution<float>(-conv_bound_, conv_bound_)(rng_);
      return;
    case TensorInit::ALog:
      for (int64_t i = 0; i < n; ++i) out[i] = std::log(std::uniform_real_distribution<float>(1.0f, 16.0f)(rng_));
      return;
    case TensorInit::DtBias:
      for (int64_t i = 0; i < n; ++i) out[i] = std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng_);
      return;
    case TensorInit::RouterBias:
      for (int64_t i = 0; i < n; ++i)
        out[i] = router_bias_std_ > 0 ? std::normal_distribution<float>(0.0f, router_bias_std_)(rng_) : 0.0f;
      return;
  }
  K3_ASSERT(false);
}

DType TensorInitializer::stored_dtype(const TensorEntry& e) const {
  if (mxfp4_ && e.info().store == TensorStore::ExpertMatrix) return DType::U8;
  return e.info().dtype;
}

}  // namespace k3
