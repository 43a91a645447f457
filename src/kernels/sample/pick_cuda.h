// The next token of each sequence chosen on the GPU from its fp32 logits, so that a decode step sends ids to
// the host instead of [B, V] logits (at 256 sequences of a 163,840-id vocabulary, 168 MB a step).
//
// The rule is model/sampler.h's, the host's definition (pick_on_host):
//   greedy       argmax, ties to the lower id;
//   temperature  p_v ∝ exp((l_v - max) / T) in double; the first id (in id order) whose running sum of p passes
//                u Σ p, u the request's draw; past the end, the last id of nonzero p.
// The one difference is the order of the double sums: each of 32 warps sums a contiguous run of ids (its lanes
// strided, then a butterfly), a scan adds the runs, and the walk adds 32 ids at a time by a warp scan, where the
// host adds id after id. A draw within a few ulps of a boundary between two
// ids may therefore pick the neighbour; the distribution and the draw are the same.
// Every row is also checked: a NaN or +inf logit, or a row of only -inf, sets its `bad` flag (the host then
// fetches the logits and reports them as the CPU path does).
//
// Plain C++ header; pointers are device pointers; runs on the default stream.
#pragma once
#include <cstdint>

namespace k3::sample::cuda {

struct PickRow {
  int32_t mode = 0;          // 0: only the check, 1: greedy, 2: temperature
  float temperature = 1.0f;  // > 0 (mode 2)
  double uniform = 0.0;      // in [0, 1) (mode 2)
};

// For each row r < B of logits [B, V]: ids[r] the pick (-1 for mode 0 or a bad row), bad[r] 1 when the row holds
// NaN or +inf or only -inf, else 0. rows: [B] PickRow. logprob (optional) [B]: for a temperature row, the picked
// id's log-probability (l_id − max) / T − log Σ exp((l_v − max) / T) from the same double sums; NaN otherwise.
void pick_tokens(const float* logits, int64_t B, int64_t V, const PickRow* rows, int32_t* ids, int32_t* bad,
                 double* logprob = nullptr);

}  // namespace k3::sample::cuda
