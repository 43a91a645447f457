// Optimizers for float64 training on a ParamStore: AdamW for vectors, norms, embeddings and the
// LM head; Muon (with K3's Per-Head Muon for q/k/v projections) for matrices; global-norm gradient
// clipping and the cosine schedule with linear warmup (K3-ARCHITECTURE.md §10).
//
// Decisions (and why):
// * Muon update scale: Moonlight's RMS matching, 0.2·sqrt(max(rows, cols)) (MuonScale::MatchAdamRms,
//   the default). An orthogonalised r×c update has RMS ≈ 1/sqrt(max(r, c)); the factor makes it
//   ≈ 0.2 (0.17 measured: NS singular values average below 1), the typical AdamW update RMS, so
//   one learning rate, one schedule and one weight decay serve both groups. K3 publishes one LR
//   schedule and one weight decay (0.1), and Moonlight -> K2 -> K3 is the Kimi lineage. Keller
//   Jordan's sqrt(max(1, rows/cols)) is available as MuonScale::ShapeRatio, but needs its own,
//   much larger learning rate.
// * Muon momentum (Moonlight / original Muon): buf = μ·buf + g; Nesterov update u = g + μ·buf
//   (plain: u = buf). The newer "lerp" form differs by the factor (1 − μ) only, which the
//   Frobenius normalisation before Newton–Schulz removes.
// * Newton–Schulz: X = u/‖u‖_F, transposed so rows <= cols, 5 steps of
//   X ← aX + (bA + cA²)X, A = XXᵀ, (a, b, c) = (3.4445, −4.7750, 2.0315). float64 throughout; a zero
//   momentum gives a zero update (the reference's +1e-7 in the norm exists for bf16 and would bias
//   small float64 gradients, so it is replaced by an exact zero test).
// * Per-Head Muon: a q/k/v projection [H·d, in] is H row blocks [d, in], one per head; each block is
//   orthogonalised and scaled (by its own block shape) exactly as if it were a separate matrix, so
//   one head's large gradient does not flatten the others' spectrum. Weight decay and momentum are
//   elementwise, so they are unaffected by the split.
// * Weight decay is decoupled (W ← W − lr·wd·W, before the update) for both optimizers, by default
//   only on tensors with two or more dimensions > 1 (matrices, embeddings, conv kernels): norm
//   gains, A_log, dt_bias, AttnRes pseudo-queries ([1, D]) and other vector-like tensors are not
//   pulled towards 0 (decay_vectors = true decays them too).
// * The router's e_score_correction_bias is not a gradient parameter (QuantileBalancer owns it):
//   the default rule makes it Frozen (no state, never touched); a custom rule may freeze others.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dist/group.h"
#include "model/config.h"
#include "model/params.h"

namespace k3::train {

enum class ParamGroup { Muon, AdamW, Frozen };
const char* param_group_name(ParamGroup g);  // "muon", "adamw", "frozen"

// The default rule, by the tensor table (model/tensor_table.h: tensor_info's trainable and muon) for
// K3 tensor names, then by shape:
//   Frozen: what the table says is not trainable: the router's selection bias (balanced by
//           QuantileBalancer, not trained by gradient).
//   AdamW:  what the table keeps off Muon (the embedding, lm_head, norm gains, A_log, dt_bias, conv
//           taps, the [1, D] AttnRes pseudo-queries); anything with at most one dimension > 1; tensors
//           of 3+ dims.
//   Muon:   every other 2-D matrix (projections, router weight, experts).
ParamGroup default_param_group(const std::string& name, const std::vector<int64_t>& shape);
using ParamGroupRule = std::function<ParamGroup(const std::string& name, const std::vector<int64_t>& shape)>;

// Per-Head Muon splits of a K3 model (the tensor table's head_blocks): name -> head count, for every
// q/k/v projection in P, in either naming:
//   KDA layer: self_attn.{q,k,v}_proj.weight            [kda_num_heads·kda_head_dim, hidden]
//   MLA layer: self_attn.q_b_proj.weight (or q_proj)    [num_attention_heads·(Dn + Dr), ...]
//              self_attn.kv_b_proj.weight               [num_attention_heads·(Dn + Dv), kv_lora_rank]
// (kv_b_proj's rows are head-major, [k_nope | v] per head.) Throws if a row count does not match.
std::map<std::string, int64_t> k3_head_splits(const ParamStore& P, const K3Config& c);

enum class MuonScale { MatchAdamRms, ShapeRatio };

struct OptimizerConfig {
  double weight_decay = 0.1;  // K3 §10
  bool decay_vectors = false;
  // AdamW
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // Muon
  double momentum = 0.95;
  bool nesterov = true;
  int ns_steps = 5;
  MuonScale muon_scale = MuonScale::MatchAdamRms;
  double muon_rms = 0.2;  // MatchAdamRms target update RMS
  // Learning-rate multiplier for the MoE router matrices (`*.block_sparse_moe.gate.weight`). Quantile
  // Balancing sets step t+1's bias from step t's scores; whatever the optimizer moves the router in
  // between shows up as load imbalance. Muon (and AdamW) move every router entry by ~lr per step
  // whatever the gradient's size, so at a small model's high learning rate and small steps that
  // drift dominates MaxVio (docs/BENCHMARKS.md). 1 = the same rate as every other matrix.
  double router_lr_scale = 1.0;
};

// True for a MoE router weight (the tensor router_lr_scale applies to).
bool is_router_weight(const std::string& name);

// One tensor's treatment (read-only view for logs and tests).
struct ParamPlan {
  std::string name;
  ParamGroup group = ParamGroup::Frozen;
  int64_t numel = 0, rows = 0, cols = 0;  // rows/cols: Muon only
  int64_t heads = 1;                      // Muon row blocks (1 = whole matrix)
  bool decay = false;
  double lr_scale = 1.0;                     // multiplies the step's lr (router_lr_scale or 1)
  int64_t state_offset = 0, state_size = 0;  // in the flat state vector
};

// Serialisable optimizer state: `header` names every tensor's slot (and the step count); `data` is
// the flat moments: AdamW m then v (2·numel), Muon momentum (numel), in plan order.
struct OptimizerState {
  nlohmann::json header;
  std::vector<double> data;
};

// Checks that `s` is a state of an optimizer with this plan and `state_size` values (format, every
// tensor's name, group, size, head split and slot) and returns its step count; throws k3::Error
// naming the first difference. Optimizer::load_state and the GPU optimizer's load_state share it.
int64_t check_optimizer_state(const OptimizerState& s, const std::vector<ParamPlan>& plan, size_t state_size);

class Optimizer {
 public:
  // Plans every tensor of P (P.names(), sorted) with `rule`; `head_splits` gives Per-Head Muon
  // counts (from k3_head_splits or by hand; names absent = whole matrix). Throws if a split names
  // a tensor that is not a Muon matrix or whose rows it does not divide.
  Optimizer(const ParamStore& P, OptimizerConfig cfg, const std::map<std::string, int64_t>& head_splits = {},
            const ParamGroupRule& rule = default_param_group);

  // One update from P's gradients (the caller zeroes/accumulates/clips them) at learning rate lr.
  // `group` (data parallelism; every rank holds the same gradients, values and state): the Muon matrices'
  // Newton–Schulz iterations, the optimizer's one model-sized O(n³) cost, are shared out by layer
  // (newton_schulz_owners); each rank orthogonalises its own and the results are all-gathered. Every rank
  // then applies the same updates, so values and state stay replicated and equal a single process's bit
  // for bit. The elementwise work (AdamW, momentum, decay) runs on every rank.
  void step(ParamStore& P, double lr, dist::Group* group = nullptr);

  int64_t steps_taken() const { return t_; }
  const OptimizerConfig& config() const { return cfg_; }
  const std::vector<ParamPlan>& plan() const { return plan_; }
  const ParamPlan& plan_of(const std::string& name) const;

  // Exact resume: save_state() after step t, load_state() into an optimizer built with the same
  // plan, continue: identical to never stopping. load_state checks names, groups, sizes and splits.
  OptimizerState save_state() const;
  void load_state(const OptimizerState& s);
  // save_state()'s header and the length of its data, without the data: what the GPU optimizer
  // needs of a plan whose state it keeps on the device (the host state is only allocated by the
  // first step() or load_state(), so a plan for a GPU run costs no model-sized host buffer).
  nlohmann::json state_header() const;
  int64_t state_size() const { return state_size_; }

 private:
  OptimizerConfig cfg_;
  std::vector<ParamPlan> plan_;
  int64_t state_size_ = 0;
  std::vector<double> state_;  // empty until the first step() or load_state()
  int64_t t_ = 0;
};

// The rank that orthogonalises each plan entry's update when Newton–Schulz is shared over `ranks` (-1 for
// entries that are not Muon): the most expensive matrices first (rows·cols·min(rows, cols) per head block),
// each to the least-loaded rank, ties to the lower rank. Depends on the plan alone.
std::vector<int> newton_schulz_owners(const std::vector<ParamPlan>& plan, int ranks);

// The quintic's coefficients: X ← a·X + (b·A + c·A²)·X, A = X·Xᵀ (the CPU's newton_schulz and the GPU's).
struct NewtonSchulzQuintic {
  static constexpr double a = 3.4445, b = -4.7750, c = 2.0315;
};

// Newton–Schulz quintic orthogonalisation of a row-major rows×cols matrix G (out may alias G):
// out ≈ U·S'·Vᵀ for G = U·S·Vᵀ, with S' in [0.682, 1.2024] after 5 steps for every σ/‖G‖_F above
// ~0.004 (not exactly 1: the quintic trades accuracy for speed; 1.2024 is its maximum on [0, 1]).
// Normalises by ‖G‖_F first; zero G gives zero.
void newton_schulz(const double* G, double* out, int64_t rows, int64_t cols, int steps = 5);

// Muon's update scale for a rows×cols (block) matrix.
double muon_scale(MuonScale s, int64_t rows, int64_t cols, double rms = 0.2);

// Global L2 norm of the gradients of `names` (all of P's gradient buffer when null), and if it
// exceeds max_norm (> 0) the same gradients scaled by max_norm/norm. Returns the pre-clip norm.
double clip_grad_norm(ParamStore& P, double max_norm, const std::vector<std::string>* names = nullptr);

// Learning rate of 0-based update `step`: linear warmup peak·(step+1)/warmup for step < warmup (the
// first update already moves; update warmup−1 is at peak), then cosine from peak at step = warmup
// to min_lr at step = total, min_lr after. Needs 0 <= warmup < total.
double cosine_lr(int64_t step, int64_t warmup, int64_t total, double peak, double min_lr);

}  // namespace k3::train
