// The token embedding for GPU training, fp32: the gather x[n] = table[ids[n]] and its backward,
// the scatter-add dtable[ids[n]] += dx[n] (the CPU truth: TrainBackend::embed_backward,
// model/training/model_train.cpp), made deterministic without atomics: positions are grouped by
// token id on the host (make_embedding_runs), and one thread per (run, column) sums its run's rows
// in position order, then adds the sum to the table row. A token's gradient row is touched by one
// thread only, so the result is bitwise reproducible and each row's sum is in position order.
// Device pointers (but make_embedding_runs: host); default stream; plain C++ header.
#pragma once
#include <cstdint>
#include <vector>

namespace k3::embed::cuda {

// Positions grouped by token id, for a scatter-add with no atomics: order = positions sorted by
// (id, position); runs of equal id: run r is order[run_start[r] .. run_start[r+1]) with id run_id[r].
struct EmbeddingRuns {
  std::vector<int32_t> order, run_start /*[R+1]*/, run_id /*[R]*/;
};
// Host. Throws k3::Error on a negative id or more than 2^31-1 positions (ids < V is the caller's
// to check, as for the forward).
// skip (optional, ids.size() flags): positions left out of every run, so their rows give the table nothing
// (input rows that replace a token's embedding, model/cuda/training/cuda_train_model.h: GpuInputRows).
EmbeddingRuns make_embedding_runs(const std::vector<int32_t>& ids, const std::vector<bool>* skip = nullptr);

// x [N, D] = table[ids[n]] rows (table [V, D], every id in [0, V)); a negative id gives a NaN row.
void embedding_forward(float* x, const float* table, const int32_t* ids, int64_t N, int64_t D);

// dtable[run_id[r]] += Σ_{i in run r, in position order} dx[order[i]]   (dtable [V, D] ACCUMULATED;
// dx [N, D]). Each column's sum is formed in double from 0 (a frequent token's run is long), then
// added to dtable's value in double and rounded once to fp32.
// order, run_start, run_id: device copies of make_embedding_runs' vectors; runs = run_id.size().
void embedding_backward(float* dtable, const float* dx, const int32_t* order, const int32_t* run_start,
                        const int32_t* run_id, int64_t runs, int64_t D);

}  // namespace k3::embed::cuda
