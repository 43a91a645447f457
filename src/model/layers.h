// The K3 decoder's blocks, each an explicit forward over a batch of token rows that may belong to
// several sequences (Segments). Per-token work (projections, norms, MoE) runs on all rows at once;
// per-sequence work (conv, KDA recurrence, MLA attention) runs segment by segment on its cache.
// Inputs are the already-normalised rows x̂ [N, hidden]; outputs are [N, hidden].
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/dtype.h"
#include "dist/group.h"
#include "kernels/ffn/glu.h"
#include "kernels/moe/router.h"
#include "model/cache.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/weights.h"

namespace k3 {

// Rows of one sequence's input in a forward that come from given vectors, not the token table: rows [at, at + n)
// of the sequence's tokens in that forward take data [n, hidden] (fp32). An image's projected tokens go in this
// way, in place of the <|media_pad|> copies that hold their places among the ids.
struct InputRows {
  int64_t at = 0, n = 0;
  const float* data = nullptr;
};

// What a caller adds to a forward beyond its ids: input rows, and debug hooks whose names match the golden
// fixture keys (attn_out.L, ffn_out.L, topk_idx.L).
struct ForwardHooks {
  // Per sequence of the forward, in order (missing or empty: every row from the token table).
  std::vector<std::vector<InputRows>> input_rows;
  std::function<void(const char* name, int64_t layer, const float* data, int64_t rows, int64_t cols)> tensor;
  std::function<void(int64_t layer, const int32_t* idx, int64_t rows, int64_t k)> topk;
  // Called after `tensor` for each block output (attn_out, ffn_out [rows, hidden], on the host): the
  // forward continues from `data` as the hook leaves it; return true when it was changed. A test feeds
  // one engine's block outputs to another with it, so that each of that engine's blocks is judged on
  // the same inputs as the reference's (model/cuda's BF16 path against its CPU twin).
  std::function<bool(const char* name, int64_t layer, float* data, int64_t rows, int64_t cols)> replace;
};

// The input rows of `hooks` as (row of the forward's batch, its data [hidden]): sequence b's rows begin at row
// row0[b] and it adds n[b] tokens. A k3::Error names a span outside its sequence's tokens.
std::vector<std::pair<int64_t, const float*>> input_rows_of(const ForwardHooks& hooks, const std::vector<int64_t>& row0,
                                                            const std::vector<int64_t>& n, int64_t hidden);
// The same over a backend's segments (anything with row0 and n: Segment, the GPU's SegmentDev).
template <class Seg>
std::vector<std::pair<int64_t, const float*>> input_rows_of(const ForwardHooks& hooks, const std::vector<Seg>& segs,
                                                            int64_t hidden) {
  std::vector<int64_t> row0, n;
  for (const Seg& s : segs) row0.push_back(s.row0), n.push_back(s.n);
  return input_rows_of(hooks, row0, n, hidden);
}

// Numerical path switches of the CPU model (model/model.h). `reference` (env K3_REFERENCE=1) forces
// the specification paths: the KDA recurrence instead of the chunked form, and expanded MLA instead
// of absorbed weights. The GPU model reads the same switch (CudaModel::set_reference).
struct PathOptions {
  bool reference = false;
  int kda_chunk = 64;
  bool profile = false;  // accumulate wall time per block kind into Model::timings()
  // The CPU twin of the GPU model's BF16 path (model/cuda): every activation that path stores in bf16
  // (GEMM inputs and most GEMM outputs, conv and norm outputs, the MLA cache rows, expert outputs) is
  // rounded to bf16 at the same point; everything else runs as usual. Its purpose is the test of that
  // path: bf16 roundings of a random model's activations move its block outputs by ~1e-2 (x̂ alone:
  // 4e-3 at the fixture's first KDA block), far more than the GPU kernels differ from one another.
  // `--device cpu --precision bf16` turns it on in the CLI (what would the GPU's bf16 path give here?).
  bool bf16_activations = false;
  // Rounds x[0..n) to bf16 when bf16_activations is set.
  void bf16(float* x, int64_t n) const {
    if (bf16_activations) round_to_bf16(x, n);
  }
  void bf16(std::vector<float>& x) const { bf16(x.data(), int64_t(x.size())); }
  void bf16(std::vector<double>& x) const {  // fp64 intermediates the GPU holds in bf16 (MLA's kvh, q_lat, o_lat)
    if (bf16_activations)
      for (double& v : x) v = bf16_to_f32(f32_to_bf16(float(v)));
  }
  // Expert parallelism (model/expert_parallel.h): with a group of more than one rank, each rank computes only the
  // routed experts it owns, and tokens reach them through all-to-all in the latent width. Every rank runs the same
  // tokens (the trunk is replicated); null or a group of one: every expert here.
  dist::Group* expert_group = nullptr;
  static PathOptions from_env();
};

void kda_attention_forward(float* out, const float* x, int64_t N, const std::vector<Segment>& segs, int64_t layer,
                           const KdaWeights& w, const K3Config& c, const PathOptions& opt);
void mla_attention_forward(float* out, const float* x, int64_t N, const std::vector<Segment>& segs, int64_t layer,
                           const MlaWeights& w, const K3Config& c, const PathOptions& opt);
// The config's gated activation (SiTU-GLU with its two caps, or SwiGLU), for the CPU and GPU FFNs.
GluParams glu_params(const K3Config& c);
// The config's router (experts, top-k, groups, renormalisation, scaling), for the CPU and GPU MoE.
moe::RouterParams router_params(const K3Config& c);

// The checks of one sequence's new tokens that every forward makes (the CPU and GPU models): at least
// one, every id inside the vocabulary, and the sequence (cached_length tokens so far) not growing past
// max_position_embeddings. k3::Error naming sequence b otherwise.
void check_new_tokens(const K3Config& c, size_t b, const std::vector<int32_t>& tokens, int64_t cached_length);

void dense_ffn_forward(float* out, const float* x, int64_t N, const GluFfnWeights& w, const K3Config& c,
                       const PathOptions& opt);
void moe_ffn_forward(float* out, const float* x, int64_t N, int64_t layer, const MoeWeights& w, const K3Config& c,
                     const ForwardHooks* hooks, const PathOptions& opt);
// One routed expert on ne latent rows: y[ne, latent] = w2(SiTU(w1 z, w3 z)), the activation on the fp32
// accumulators, y rounded to bf16 on the bf16 path. The single-process MoE and every expert-parallel rank run it.
void routed_expert_forward(float* y, const float* z, int64_t ne, const ExpertWeights& w, const K3Config& c,
                           const PathOptions& opt);

}  // namespace k3
