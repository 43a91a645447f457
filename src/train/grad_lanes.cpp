#include "train/grad_lanes.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/memory.h"
#include "model/training/ffn_block.h"
#include "train/policy_gradient.h"

namespace k3::train {

namespace {

// body(i) for i in [0, n), side by side (OpenMP, one index per thread at a time). An exception must
// not leave an OpenMP region, so each is caught in its iteration; after the loop the first one (by
// index) is raised again as a k3::Error with its message.
template <class Body>
void parallel_for_rethrow(int64_t n, Body&& body) {
  std::vector<std::string> error(static_cast<size_t>(n));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    try {
      body(i);
    } catch (const std::exception& e) {
      error[size_t(i)] = e.what();
    }
  }
  for (const std::string& e : error)
    if (!e.empty()) fail(e);
}

}  // namespace

void check_replay_count(const std::vector<std::vector<int32_t>>& pieces, const std::vector<RouterReplay>* replay) {
  if (replay && replay->size() != pieces.size())
    fail("router replay: ", replay->size(), " routings for ", pieces.size(), " sequences");
}

std::vector<int64_t> assign_lanes(const std::vector<std::vector<int32_t>>& pieces, int64_t lanes) {
  if (lanes < 1) fail("gradient lanes: need at least 1, got ", lanes);
  std::vector<size_t> order(pieces.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pieces[a].size() > pieces[b].size(); });
  std::vector<int64_t> load(size_t(lanes), 0), lane(pieces.size(), 0);
  for (size_t i : order) {
    const size_t l = size_t(std::min_element(load.begin(), load.end()) - load.begin());  // first minimum
    lane[i] = int64_t(l);
    load[l] += int64_t(pieces[i].size());
  }
  return lane;
}

GradLanes::GradLanes(ParamStore& P, int64_t lanes) : P_(P) {
  if (lanes < 1) fail("--grad-lanes: need at least 1 gradient lane, got ", lanes);
  // Each lane past the first holds a float64 gradient buffer the size of the model.
  const double bytes = double(lanes - 1) * double(P.grads().size()) * double(sizeof(double));
  require_memory(saturated_bytes(bytes),
                 "--grad-lanes " + std::to_string(lanes) + " (a float64 gradient buffer of the model per lane)");
  for (int64_t l = 1; l < lanes; ++l) extra_.push_back(ParamStore::gradient_lane(P));
}

double GradLanes::step(const K3Config& c, const std::vector<std::vector<int32_t>>& pieces, double grad_scale,
                       const std::function<const double*(int64_t layer)>& router_bias,
                       const std::function<void(int64_t layer, const double* scores, int64_t N)>& on_router_scores,
                       const std::vector<TokenMask>* trained, const std::vector<TokenWeights>* weights,
                       const std::vector<RouterReplay>* replay) {
  check_per_token(pieces, trained);
  check_per_token(pieces, weights);
  check_replay_count(pieces, replay);
  const int64_t n = int64_t(pieces.size()), nl = lanes();
  const std::vector<int64_t> lane_of = assign_lanes(pieces, nl);
  std::vector<std::vector<size_t>> work(static_cast<size_t>(nl));
  for (int64_t i = 0; i < n; ++i) work[size_t(lane_of[size_t(i)])].push_back(size_t(i));

  struct Scores {
    int64_t layer, N;
    std::vector<double> s;
  };
  std::vector<double> loss(static_cast<size_t>(n), 0.0);
  std::vector<std::vector<Scores>> scores(static_cast<size_t>(n));
  for (ParamStore& g : extra_) g.zero_grads();

  // One thread per lane; kernels inside run single-threaded (nested regions are inactive and the
  // OpenMP build of OpenBLAS runs serially inside a parallel region). Even one lane runs inside
  // the region: the multi-threaded kernels do not give the same bits at every thread count (measured:
  // the serial loop's gradients at 1 and 2 threads differ), single-threaded ones do.
  parallel_for_rethrow(nl, [&](int64_t l) {
    ParamStore& G = l == 0 ? P_ : extra_[size_t(l - 1)];
    for (size_t i : work[size_t(l)]) {
      TrainHooks h;
      h.router_bias = router_bias;
      if (on_router_scores)
        h.on_moe = [&scores, i](int64_t layer, const MoeTape& t) { scores[i].push_back({layer, t.N, t.scores}); };
      if (replay) h.router_replay = replay_hook((*replay)[i], c, int64_t(pieces[i].size()));
      loss[i] = sequence_loss(G, c, pieces[i], {}, true, grad_scale, nullptr, &h, trained ? &(*trained)[i] : nullptr,
                              weights ? &(*weights)[i] : nullptr);
    }
  });

  std::vector<double>& g0 = P_.grads();
  for (ParamStore& G : extra_) {
    const std::vector<double>& g = G.grads();
    for (size_t k = 0; k < g0.size(); ++k) g0[k] += g[k];
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    sum += loss[size_t(i)];
    if (on_router_scores)
      for (const Scores& s : scores[size_t(i)]) on_router_scores(s.layer, s.s.data(), s.N);
  }
  return sum;
}

double forward_losses(ParamStore& P, const K3Config& c, const std::vector<std::vector<int32_t>>& pieces,
                      const TrainHooks* hooks, const std::vector<TokenMask>* trained) {
  check_per_token(pieces, trained);
  const int64_t n = int64_t(pieces.size());
  std::vector<double> loss(static_cast<size_t>(n), 0.0);
  parallel_for_rethrow(n, [&](int64_t i) {
    loss[size_t(i)] = sequence_loss(P, c, pieces[size_t(i)], {}, false, 0.0, nullptr, hooks,
                                    trained ? &(*trained)[size_t(i)] : nullptr);
  });
  double sum = 0.0;
  for (double l : loss) sum += l;
  return sum;
}

std::vector<std::vector<double>> forward_logprobs(ParamStore& P, const K3Config& c,
                                                  const std::vector<std::vector<int32_t>>& pieces,
                                                  const std::function<const double*(int64_t layer)>& router_bias,
                                                  const std::vector<RouterReplay>* replay,
                                                  std::vector<RouterReplay>* topk) {
  check_replay_count(pieces, replay);
  const int64_t n = int64_t(pieces.size());
  std::vector<std::vector<double>> out(pieces.size());
  if (topk) topk->assign(pieces.size(), RouterReplay(size_t(c.num_hidden_layers)));
  parallel_for_rethrow(n, [&](int64_t i) {
    const std::vector<int32_t>& ids = pieces[size_t(i)];
    TrainHooks h;
    h.router_bias = router_bias;
    if (replay) h.router_replay = replay_hook((*replay)[size_t(i)], c, int64_t(ids.size()));
    if (topk) h.on_moe = [&, i](int64_t layer, const MoeTape& t) { (*topk)[size_t(i)][size_t(layer)] = t.topk; };
    out[size_t(i)] = token_logprobs(P, c, ids, &h);
  });
  return out;
}

}  // namespace k3::train
