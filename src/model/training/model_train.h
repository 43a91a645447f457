// The K3 text model for training: float64 forward with saved activations, and the explicit
// backward through every block (K3-ARCHITECTURE.md §5), over ParamStore parameters.
//
// The forward mirrors src/model/model.cpp step for step (embedding; per layer AttnRes -> RMSNorm ->
// KDA or MLA -> partial block sum -> AttnRes -> RMSNorm -> dense FFN or LatentMoE; final AttnRes,
// norm, lm_head), and the backward walks it in reverse. AttnRes mixes *snapshots* of the running
// block sum, so every version of that sum is a node with its own gradient buffer; a node's gradient
// is complete once every later use has been walked back, which reverse program order guarantees.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "model/training/kda_block.h"
#include "model/training/mla_block.h"

namespace k3::train {

struct MoeTape;

struct TrainHooks {
  // Called after each MoE layer's forward with its tape (router scores and selections).
  std::function<void(int64_t layer, const MoeTape& tape)> on_moe;
  // The selection-only router bias of a layer ([E]); default: the model's e_score_correction_bias.
  std::function<const double*(int64_t layer)> router_bias;
  // Router replay: the experts each position of MoE layer `layer` uses, [T, K] in selection order, instead of
  // the router's own selection (null, or no function: the router selects). RL trains on the routing its rollouts
  // took (train/episode.h, RouterReplay).
  std::function<const int32_t*(int64_t layer)> router_replay;
  // Block outputs as they are computed ("attn_out" / "ffn_out", the fixture's names), [T, hidden].
  std::function<void(const char* name, int64_t layer, const double* data, int64_t rows, int64_t cols)> tensor;
};

// One sequence (positions 0..T-1, ids[t+1] the target of position t). Returns the summed
// next-token cross-entropy over its T-1 positions. When `backward`, parameter gradients of
// grad_scale * (that sum) are ACCUMULATED into P's gradient buffer. `logits` (optional) receives
// [T, V].
double sequence_loss(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids, bool backward,
                     double grad_scale, std::vector<double>* logits = nullptr, const TrainHooks* hooks = nullptr);

// Rows of a sequence's input that come from given vectors, not the token table: positions [at, at + n) take
// data [n, hidden] (an image's projected tokens, as inference's InputRows in model/layers.h; the ids there hold
// the placeholder). Those positions are inputs only: no position is trained to predict them (the targets of
// positions at - 1 .. at + n - 2 are skipped), and the token table gets no gradient from them.
struct TrainInputRows {
  int64_t at = 0, n = 0;
  const double* data = nullptr;  // [n, hidden]
  double* grad = nullptr;        // [n, hidden], optional: OVERWRITTEN by the backward, grad_scale * ∂loss/∂data
};

// Which tokens of a sequence are trained: trained[t] != 0 puts position t - 1's prediction of token t into the
// loss (trained[0] is not read). [T] per sequence; where a step gives none, every token after the first is
// trained. Supervised fine-tuning trains on the tokens the assistant generates and not on the prompt's
// (train/sft_data.h).
using TokenMask = std::vector<uint8_t>;

// Per-token weights of a sequence's loss: token t's cross-entropy (position t - 1 predicting it) counts weight[t]
// times (weight[0] is not read), in the loss and its gradient. A policy-gradient step's coefficients
// (train/policy_gradient.h); any sign.
using TokenWeights = std::vector<double>;

// sequence_loss with input rows (spans inside the sequence, not overlapping; a k3::Error names one that is not)
// and, optionally, the trained tokens and their weights ([T] each; a k3::Error when a size is not T). Returns the
// summed (weighted) cross-entropy over the positions whose target is a trained token (target_count of them).
double sequence_loss(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
                     const std::vector<TrainInputRows>& rows, bool backward, double grad_scale,
                     std::vector<double>* logits = nullptr, const TrainHooks* hooks = nullptr,
                     const TokenMask* trained = nullptr, const TokenWeights* weights = nullptr);

// How many positions of a sequence of T tokens with these input rows (and trained tokens, optional) predict a
// token: T - 1, less those whose next position is an input row or an untrained token.
int64_t target_count(int64_t T, const std::vector<TrainInputRows>& rows, const TokenMask* trained = nullptr);

// A k3::Error unless the masks (or weights) are null or hold one entry per piece, each of its piece's length.
void check_per_token(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained);
void check_per_token(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenWeights>* weights);

// The routing a sequence took, for router replay: per layer, [T, K] experts of each position in selection order
// (empty for a dense layer). A k3::Error from replay_hook when a MoE layer's entry is not T × K.
using RouterReplay = std::vector<std::vector<int32_t>>;
std::function<const int32_t*(int64_t layer)> replay_hook(const RouterReplay& r, const K3Config& c, int64_t T);

// A decoding sequence's float64 state (model/training/engine_f64.h): per layer, its KDA or MLA state (the other
// entry unused), and the tokens it holds.
struct DecodeState {
  int64_t length = 0;
  std::vector<KdaDecodeState> kda;
  std::vector<MlaDecodeState> mla;
};

// The float64 forward of `ids`, continuing the sequence `state` holds (fresh: a DecodeState{}), which then holds
// them too: `logits` gets [T, V], one row per new token. The same schedule and block forwards as sequence_loss, but
// KDA's recurrence runs token by token from the state (the chunked form starts at zero), and it reads P only.
// rows: input rows among the new tokens (at relative to them). hooks: on_moe, router_bias and router_replay.
void sequence_decode(const ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
                     const std::vector<TrainInputRows>& rows, DecodeState& state, std::vector<double>& logits,
                     const TrainHooks* hooks = nullptr);

// Names of the parameters that are trained (everything float except the router's selection bias).
std::vector<std::string> trainable_names(const ParamStore& P);

}  // namespace k3::train
