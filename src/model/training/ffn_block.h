// Training (float64, explicit forward/backward) of K3's FFN blocks (K3-ARCHITECTURE.md §5.5, §5.6):
//   - the GLU MLP y = down( act(gate x, up x) ), act = SiTU-GLU (or SwiGLU when hidden_act is silu);
//     used by dense layer 0 (`mlp.`), the fused shared experts (`shared_experts.`) and every routed
//     expert (`experts.E.` with w1 = gate, w3 = up, w2 = down);
//   - Stable LatentMoE: sigmoid router on the full-width x̂ with a selection-only bias and
//     group-limited top-k; latent down-projection; routed experts in the latent; weighted sum;
//     RMSNorm of the aggregate; up-projection; plus the shared experts.
// Semantics follow the inference path (src/model/ffn_layer.cpp, src/kernels/{ffn,moe,norm}), in f64.
// Every block is per token (rows independent), so x is [N, hidden] with any N.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"

namespace k3::train {

// ---- GLU MLP ----
// Saved activations of one GLU MLP applied to N rows of width D with intermediate width I.
struct GluTape {
  int64_t N = 0, D = 0, I = 0;
  std::vector<double> x;  // [N, D] input
  std::vector<double> g;  // [N, I] gate pre-activation (gate x)
  std::vector<double> u;  // [N, I] up pre-activation (up x)
  std::vector<double> h;  // [N, I] act(g, u), the input of down
};

// mlp_prefix names a GLU MLP whose tensors have the leaves of the dense and shared FFNs
// ({gate,up,down}_proj) or of the routed experts ({w1,w3,w2}), as the tensor table names them; the
// first form wins when both exist.
// Shapes: gate/up [I, D], down [D, I]; I is read from the gate tensor. y: [N, D] (overwritten).
void glu_mlp_forward(const ParamStore& P, const std::string& mlp_prefix, const K3Config& c, const double* x, int64_t N,
                     int64_t D, double* y, GluTape* tape);
// dx [N, D] overwritten; the three weight gradients accumulated.
void glu_mlp_backward(ParamStore& P, const std::string& mlp_prefix, const K3Config& c, const GluTape& tape,
                      const double* dy, double* dx);

// ---- Dense FFN (layers < first_k_dense_replace): DenseGate/DenseUp/DenseDown under the layer prefix ----
void dense_ffn_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, GluTape* tape);
void dense_ffn_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer, const GluTape& tape,
                        const double* dy, double* dx);

// ---- Stable LatentMoE: the Moe*, Expert* and Shared* kinds under the layer prefix ----
struct MoeTape {
  int64_t N = 0, E = 0, K = 0, D = 0, L = 0;  // rows, experts, top-k, hidden, latent
  std::vector<double> x;                      // [N, D] input
  std::vector<double> scores;                 // [N, E] unbiased sigmoid router scores s (for Quantile Balancing)
  std::vector<int32_t> topk;                  // [N, K] selected experts, in selection order (best s + bias first)
  std::vector<double> weight;                 // [N, K] mixture weights (renormalised, scaled)
  std::vector<double> sel_sum;                // [N] Σ_selected s (the renormalisation denominator, without 1e-20)
  std::vector<double> z;                      // [N, L] latent x̂ (routed_expert_down_proj x)
  // Per expert: the (token, slot) pairs routed to it, its GLU tape on the gathered latent rows and
  // its output rows y_e [rows, L] (needed for the gradient of the mixture weights).
  std::vector<std::vector<std::pair<int64_t, int32_t>>> rows;
  std::vector<GluTape> expert_tape;
  std::vector<std::vector<double>> expert_out;
  std::vector<double> agg;     // [N, L] u = Σ_k w_k y_{e_k} (before the norm)
  std::vector<double> normed;  // [N, L] input of routed_expert_up_proj
  bool has_shared = false;
  GluTape shared;
};

// router_bias [E]: the selection-only bias (never in the weights, never trained); null = zeros.
// The caller passes P.p(tensor_name_at(prefix, TensorKind::MoeRouterBias)) or its own.
// forced_topk (optional) [N, K]: the experts each row uses instead of the router's selection (router replay).
void moe_ffn_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer, const double* x,
                     int64_t N, double* y, MoeTape* tape, const double* router_bias,
                     const int32_t* forced_topk = nullptr);
// The router weight gets its gradient through the unbiased scores of the selected experts (via the
// renormalisation and the sigmoid); selection is piecewise constant (no gradient). Experts that no
// row selected get no gradient. dx [N, hidden] overwritten.
void moe_ffn_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer, const MoeTape& tape,
                      const double* dy, double* dx);

}  // namespace k3::train
