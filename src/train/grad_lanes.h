// Data-parallel gradients of one optimizer step on the CPU.
//
// Why: a k3-tiny sequence's products are 128 wide and its KDA has 4 heads, too little work for
// OpenBLAS or the per-head loops to keep two threads busy. With the sequences of a step run one after
// another, the threads spend much of the step in libgomp's barrier spin (docs/BENCHMARKS.md, "Gradient
// lanes"). Running whole sequences side by side, each on one thread with every kernel inside
// single-threaded, removes that wait.
//
// How: the step's sequences ("pieces": windows cut at document boundaries) are dealt to `lanes`
// gradient buffers, longest first to the least-loaded lane (cost = tokens, ties to the lower lane).
// The lanes run at once; each adds its pieces' gradients into its own buffer in piece order, and the
// buffers are summed into P's gradient in lane order. Per-piece losses and the router scores for
// Quantile Balancing are combined afterwards in piece order, exactly as the serial loop did.
//
// Determinism: the assignment depends only on the pieces and the lane count, and every kernel runs
// single-threaded inside a lane, so for a given lane count the result does not depend on the number
// of threads or on scheduling. The trainer saves the lane count in its checkpoints, so a resumed run
// sums in the same order (exact resume), on any machine. One lane is bit-identical to the serial
// loop run single-threaded. Different lane counts differ only in the rounding of the gradient sum
// (~1e-16 relative).
//
// Memory: each lane beyond the first holds one float64 gradient buffer (the size of the model).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "model/training/model_train.h"

namespace k3::train {

// A k3::Error unless `replay` is null or holds one routing per piece.
void check_replay_count(const std::vector<std::vector<int32_t>>& pieces, const std::vector<RouterReplay>* replay);

// Lane of each piece (longest first to the least-loaded lane; deterministic).
std::vector<int64_t> assign_lanes(const std::vector<std::vector<int32_t>>& pieces, int64_t lanes);

class GradLanes {
 public:
  // P must outlive this object and keep its buffers (values are read through the lanes).
  GradLanes(ParamStore& P, int64_t lanes);
  int64_t lanes() const { return int64_t(extra_.size()) + 1; }

  // Σ over pieces of sequence_loss(piece), with grad_scale * its gradient ADDED to P's gradient
  // buffer (backward = true). `router_bias` as in TrainHooks; `on_router_scores(layer, scores, N)`
  // receives every MoE layer's unbiased scores [N, E], piece by piece in order, after the pieces ran.
  // `trained`, `weights`, `replay` (optional): each piece's trained tokens, their weights and its routing
  // (model_train.h).
  double step(const K3Config& c, const std::vector<std::vector<int32_t>>& pieces, double grad_scale,
              const std::function<const double*(int64_t layer)>& router_bias,
              const std::function<void(int64_t layer, const double* scores, int64_t N)>& on_router_scores,
              const std::vector<TokenMask>* trained = nullptr, const std::vector<TokenWeights>* weights = nullptr,
              const std::vector<RouterReplay>* replay = nullptr);

 private:
  ParamStore& P_;
  std::vector<ParamStore> extra_;  // lanes 1..n-1; lane 0 accumulates into P itself
};

// Σ over pieces of the forward-only sequence_loss (no gradients), pieces run side by side, each
// single-threaded; the sum is taken in piece order, so it does not depend on the thread count. `hooks` may only read (no on_moe).
double forward_losses(ParamStore& P, const K3Config& c, const std::vector<std::vector<int32_t>>& pieces,
                      const TrainHooks* hooks, const std::vector<TokenMask>* trained = nullptr);

// log π(ids[t]) of every token after the first of each piece ([T] per piece, entry 0 is 0), pieces side by side as
// forward_losses runs them. `router_bias` as in TrainHooks; `replay` (optional): each piece's routing. `topk`
// (optional) receives each piece's own selection per MoE layer ([T, K], RouterReplay's layout), to compare with
// a recorded routing.
std::vector<std::vector<double>> forward_logprobs(ParamStore& P, const K3Config& c,
                                                  const std::vector<std::vector<int32_t>>& pieces,
                                                  const std::function<const double*(int64_t layer)>& router_bias,
                                                  const std::vector<RouterReplay>* replay = nullptr,
                                                  std::vector<RouterReplay>* topk = nullptr);

}  // namespace k3::train
