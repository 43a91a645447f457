// Random initial values for the tensor table (tensor_table.h: TensorInit), shared by `k3 init`, which
// writes them to disk (init_random.h), and by training from scratch, which keeps them in memory
// (model/params.h: ParamStore::random_init). Both draw through one TensorInitializer in table order,
// so a seed gives the same model either way.
//
// The rules per tensor (TensorInit): matrices ~ N(0, initializer_range); norm gains 1; AttnRes
// pseudo-queries 0 (the paper's init: uniform mixing) or N(0, initializer_range) with
// random_attnres_queries (tests use that to exercise AttnRes); conv taps ~ U(±1/sqrt(K)); A_log = log
// U(1, 16) (so A in [1, 16]); dt_bias ~ U(±0.5); the router bias 0, or N(0, router_bias_std).
#pragma once
#include <cstdint>
#include <random>

#include "core/dtype.h"
#include "model/config.h"
#include "model/tensor_table.h"

namespace k3 {

struct RandomInitOptions {
  uint64_t seed = 0;
  bool mxfp4_experts = false;
  bool random_attnres_queries = false;
  float router_bias_std = 0.0f;  // nonzero exercises the selection-only bias
  // ParamStore::random_init only: draw each block of kInitBlock values of each tensor from its own
  // stream (seeded by seed, the tensor's table index and the block), in parallel over the host's
  // threads. Same rules and distributions, different values from the single stream `k3 init` uses;
  // the same for any thread count. For throughput benchmarks of multi-billion-parameter configs,
  // where one stream takes minutes.
  bool parallel_streams = false;
  // `k3 init` only: write the released checkpoint's shard layout (model/release_layout.h) instead of one
  // model.safetensors.
  bool release_shards = false;
};
inline constexpr int64_t kInitBlock = int64_t(1) << 22;

// One initialisation's random stream: a std::mt19937_64 seeded with opt.seed, drawn tensor by
// tensor in TensorTable::entries() order (the order is part of the result: see tensor_table.h).
class TensorInitializer {
 public:
  TensorInitializer(const K3Config& c, const RandomInitOptions& opt);

  // Starts tensor e. The previous tensor must have been drawn to its end.
  void begin(const TensorEntry& e);
  // Starts a tensor of n values drawn by rule `init`: for tensors outside the text table (the vision tower's,
  // vision_tensor_table), drawn after it from the same stream.
  void begin(TensorInit init, int64_t n);
  // The next n values of the current tensor, row-major, as drawn: float32, before rounding to the
  // stored dtype (so that an MXFP4 expert is quantised from the same values a BF16 one rounds).
  void fill(float* out, int64_t n);

  // What k3 init stores e as: tensor_info(e.kind).dtype (BF16 or F32), or U8, an MXFP4 pair, for a
  // routed expert when mxfp4_experts is set.
  DType stored_dtype(const TensorEntry& e) const;

 private:
  float std_ = 0, conv_bound_ = 0, router_bias_std_ = 0;
  bool random_queries_ = false, mxfp4_ = false;
  TensorInit mode_ = TensorInit::One;
  int64_t left_ = 0;  // values of the current tensor not yet drawn
  std::normal_distribution<float> normal_;
  std::mt19937_64 rng_;
};

}  // namespace k3
