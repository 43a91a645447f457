// KDA attention block, training forward and backward in float64. See kda_block.h for the math and
// src/model/kda_layer.cpp + src/kernels/kda/kda_cpu.cpp for the inference twin this must match.
//
// Notation in the comments: x [T, hidden] is the block input; for any forward quantity a, "da" is the
// gradient of the loss w.r.t. a. A projection a = x W^T (W [out, in]) has the backward
// dW += da^T x and dx += da W.
#include "model/training/kda_block.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/gemm/linear_f64.h"
#include "kernels/kda/kda_chunk_f64.h"
#include "kernels/kda/kda_f64.h"
#include "model/tensor_table.h"

namespace k3::train {
namespace {

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }  // exp overflow -> 0, no NaN

struct Dims {
  int64_t hid = 0, H = 0, D = 0, HD = 0, K = 0;
  double lower_bound = 0.0;  // gate_lower_bound (< 0)
  double norm_eps = 0.0;     // o_norm epsilon (rms_norm_eps)
  double scale = 0.0;        // 1/sqrt(D)
};

Dims dims_of(const K3Config& c, int64_t layer) {
  K3_CHECK(layer >= 0 && layer < int64_t(c.layer_kind.size()), "kda_block: layer ", layer, " is outside [0, ",
           c.layer_kind.size(), ") of ", c.source);
  K3_CHECK(c.layer_kind[size_t(layer)] == AttnKind::KDA, "kda_block: layer ", layer, " of ", c.source,
           " is not a KDA layer");
  Dims d;
  d.hid = c.hidden_size;
  d.H = c.kda_num_heads;
  d.D = c.kda_head_dim;
  d.HD = d.H * d.D;
  d.K = c.short_conv_kernel_size;
  K3_CHECK(d.hid >= 1 && d.H >= 1 && d.D >= 1 && d.K >= 1, "kda_block: bad dimensions in ", c.source, ": hidden ",
           d.hid, ", heads ", d.H, ", head_dim ", d.D, ", short_conv_kernel_size ", d.K);
  K3_CHECK(std::isfinite(c.gate_lower_bound) && c.gate_lower_bound < 0.0f, "kda_block: gate_lower_bound must be ",
           "finite and negative, got ", c.gate_lower_bound, " in ", c.source);
  d.lower_bound = double(c.gate_lower_bound);
  d.norm_eps = double(c.rms_norm_eps);
  d.scale = 1.0 / std::sqrt(double(d.D));
  return d;
}

constexpr double kL2Eps = 1e-6;  // q/k L2-norm epsilon, as in kda_layer.cpp (fla use_qk_l2norm_in_kernel)

// The block's tensor names, and their value/gradient pointers with sizes checked (k3::Error names the tensor).
struct Names {
  std::string q, k, v, qc, kc, vc, fa, fb, b, g, o, alog, dt, onorm;
  Names(const std::string& prefix) {
    using K = TensorKind;
    auto n = [&](K kind) { return tensor_name_at(prefix, kind); };
    q = n(K::KdaQ), k = n(K::KdaK), v = n(K::KdaV), qc = n(K::KdaQConv), kc = n(K::KdaKConv), vc = n(K::KdaVConv);
    fa = n(K::KdaFA), fb = n(K::KdaFB), b = n(K::KdaB), g = n(K::KdaG), o = n(K::KdaO);
    alog = n(K::KdaALog), dt = n(K::KdaDtBias), onorm = n(K::KdaONorm);
  }
};

template <class Ptr>
struct Tensors {
  Ptr q, k, v, qc, kc, vc, fa, fb, b, g, o, alog, dt, onorm;
};

// get(name, numel) is P.p or P.g. A_log may be padded (the release stores head_dim entries), so it is
// only required to have at least H entries; the first H are the per-head values.
template <class Ptr, class Get>
Tensors<Ptr> resolve(const ParamStore& P, const Names& n, const Dims& d, Get get) {
  K3_CHECK(P.numel(n.alog) >= d.H, "parameter '", n.alog, "' has ", P.numel(n.alog), " elements, expected at least ",
           d.H, " (one per head)");
  Tensors<Ptr> t;
  t.q = get(n.q, d.HD * d.hid), t.k = get(n.k, d.HD * d.hid), t.v = get(n.v, d.HD * d.hid);
  t.qc = get(n.qc, d.HD * d.K), t.kc = get(n.kc, d.HD * d.K), t.vc = get(n.vc, d.HD * d.K);
  t.fa = get(n.fa, d.D * d.hid), t.fb = get(n.fb, d.HD * d.D), t.b = get(n.b, d.H * d.hid);
  t.g = get(n.g, d.HD * d.hid), t.o = get(n.o, d.hid * d.HD);
  t.alog = get(n.alog, -1), t.dt = get(n.dt, d.HD), t.onorm = get(n.onorm, d.D);
  return t;
}

}  // namespace

void kda_block_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, KdaBlockTape* tape, KdaDecodeState* state) {
  const Dims d = dims_of(c, layer);
  K3_CHECK(!(tape && state), "kda_block_forward: a decoding forward saves no tape");
  const Names names(prefix);
  const auto W = resolve<const double*>(P, names, d, [&](const std::string& n, int64_t e) { return P.p(n, e); });
  K3_CHECK(T >= 0, "kda_block_forward: T must be >= 0, got ", T);
  const int64_t hid = d.hid, H = d.H, D = d.D, HD = d.HD;

  KdaBlockTape local;
  KdaBlockTape& tp = tape ? *tape : local;  // without a tape the intermediates live here and are dropped
  // A batch-invariant forward (kernels/gemm/linear_f64.h) runs the recurrence as decoding does: token by token.
  if (f64_batch_invariant()) tp.recurrent_reference = true;
  K3_CHECK(tp.state_every >= 1, "kda_block_forward: tape.state_every must be >= 1, got ", tp.state_every);
  tp.T = T;
  auto sized = [](std::vector<double>& v, int64_t n) { v.assign(static_cast<size_t>(n), 0.0); };
  tp.x.assign(x, x + T * hid);
  for (auto* v : {&tp.qp, &tp.kp, &tp.vp, &tp.qc, &tp.kc, &tp.vc, &tp.qs, &tp.ks, &tp.q, &tp.k, &tp.v, &tp.z, &tp.sg,
                  &tp.g, &tp.o, &tp.gp, &tp.on})
    sized(*v, T * HD);
  for (auto* v : {&tp.q_inv, &tp.k_inv, &tp.beta, &tp.o_inv}) sized(*v, T * H);
  sized(tp.fa, T * D);
  const int64_t n_ckpt = tape ? (T + tp.state_every - 1) / tp.state_every : 0;
  sized(tp.states, n_ckpt * H * D * D);
  if (T == 0) return;

  // 1. q/k/v projections, causal conv + SiLU.
  linear_forward(tp.qp.data(), x, W.q, T, hid, HD);
  linear_forward(tp.kp.data(), x, W.k, T, hid, HD);
  linear_forward(tp.vp.data(), x, W.v, T, hid, HD);
  if (state) {
    for (auto* v : {&state->q_tail, &state->k_tail, &state->v_tail})
      if (v->empty()) v->assign(size_t((d.K - 1) * HD), 0.0);
    if (state->S.empty()) state->S.assign(size_t(H * D * D), 0.0);
    K3_CHECK(int64_t(state->q_tail.size()) == (d.K - 1) * HD && state->k_tail.size() == state->q_tail.size() &&
                 state->v_tail.size() == state->q_tail.size() && int64_t(state->S.size()) == H * D * D,
             "kda_block_forward: layer ", layer, "'s decoding state is from another config");
  }
  kda::conv_silu_forward(tp.qc.data(), tp.qs.data(), tp.qp.data(), T, HD, W.qc, d.K,
                         state ? state->q_tail.data() : nullptr);
  kda::conv_silu_forward(tp.kc.data(), tp.ks.data(), tp.kp.data(), T, HD, W.kc, d.K,
                         state ? state->k_tail.data() : nullptr);
  kda::conv_silu_forward(tp.vc.data(), tp.v.data(), tp.vp.data(), T, HD, W.vc, d.K,
                         state ? state->v_tail.data() : nullptr);
  if (state)  // the new tails: the last K-1 rows of (old tail, new inputs)
    for (auto [tail, in] : {std::pair{&state->q_tail, &tp.qp}, {&state->k_tail, &tp.kp}, {&state->v_tail, &tp.vp}}) {
      std::vector<double> all(*tail);
      all.insert(all.end(), in->begin(), in->end());
      tail->assign(all.end() - std::ptrdiff_t((d.K - 1) * HD), all.end());
    }

  // 2. Per-head L2 norm of q and k (v is not normalised).
  kda::l2norm_forward(tp.q.data(), tp.q_inv.data(), tp.qs.data(), T * H, D, kL2Eps);
  kda::l2norm_forward(tp.k.data(), tp.k_inv.data(), tp.ks.data(), T * H, D, kL2Eps);

  // 3. beta = sigmoid(b_proj x).
  linear_forward(tp.beta.data(), x, W.b, T, hid, H);
  for (double& b : tp.beta) b = sigmoid(b);

  // 4. Gate: z = f_b(f_a x); g = lower_bound * sigmoid(exp(A_log[h]) (z + dt_bias)) (kernels/kda/kda_f64.h).
  linear_forward(tp.fa.data(), x, W.fa, T, hid, D);
  linear_forward(tp.z.data(), tp.fa.data(), W.fb, T, D, HD);
  kda::gate_forward(tp.g.data(), tp.sg.data(), tp.z.data(), W.alog, W.dt, d.lower_bound, T, H, D);

  // 5. The recurrence (kernels/kda/kda_chunk_f64.h), chunked unless the tape asks for the recurrent reference twin. The
  // states entering every state_every-th token (= every chunk) are saved for the backward.
  double* states = n_ckpt > 0 ? tp.states.data() : nullptr;
  if (tp.recurrent_reference || state)
    kda::kda_recurrent_forward_f64(tp.o.data(), states, tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(),
                                   tp.beta.data(), d.scale, T, H, D, D, tp.state_every,
                                   state ? state->S.data() : nullptr);
  else
    kda::kda_chunk_forward_f64(tp.o.data(), states, tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(), tp.beta.data(),
                               d.scale, T, H, D, D, tp.state_every);

  // 6. Gated RMSNorm per head (weight shared by heads): on = o * inv * o_norm * sigmoid(g_proj x); y = o_proj on.
  linear_forward(tp.gp.data(), x, W.g, T, hid, HD);
  kda::gated_rmsnorm_forward(tp.on.data(), tp.o_inv.data(), tp.o.data(), tp.gp.data(), W.onorm, d.norm_eps, T * H, D);
  linear_forward(y, tp.on.data(), W.o, T, HD, hid);
}

void kda_block_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                        const KdaBlockTape& tp, const double* dy, double* dx) {
  const Dims d = dims_of(c, layer);
  const Names names(prefix);
  const auto W = resolve<const double*>(P, names, d, [&](const std::string& n, int64_t e) { return P.p(n, e); });
  const auto G = resolve<double*>(P, names, d, [&](const std::string& n, int64_t e) { return P.g(n, e); });
  const int64_t T = tp.T, hid = d.hid, H = d.H, D = d.D, HD = d.HD;
  K3_CHECK(int64_t(tp.x.size()) == T * hid && int64_t(tp.q.size()) == T * HD && int64_t(tp.fa.size()) == T * D &&
               int64_t(tp.beta.size()) == T * H,
           "kda_block_backward: the tape (T = ", T, ") does not match the config of layer ", layer, " (", c.source,
           ")");
  const int64_t every = tp.state_every;
  K3_CHECK(every >= 1 && int64_t(tp.states.size()) == (T + every - 1) / every * H * D * D,
           "kda_block_backward: the tape holds no recurrent states (was kda_block_forward given this tape?)");
  std::fill(dx, dx + T * hid, 0.0);
  if (T == 0) return;
  const double* x = tp.x.data();
  auto buf = [](int64_t n) { return std::vector<double>(static_cast<size_t>(n), 0.0); };

  // 6. Output projection: y = on Wo^T.
  std::vector<double> don = buf(T * HD);
  linear_backward(don.data(), G.o, dy, tp.on.data(), W.o, T, HD, hid);  // don = dy Wo; dWo += dy^T on
  std::vector<double> dgp = buf(T * HD), d_o = buf(T * HD);
  kda::gated_rmsnorm_backward(d_o.data(), dgp.data(), G.onorm, don.data(), tp.o.data(), tp.o_inv.data(), tp.gp.data(),
                              W.onorm, T * H, D);
  linear_backward(dx, G.g, dgp.data(), x, W.g, T, hid, HD, true);  // gp = g_proj x

  // 5. The recurrence, in the form the forward used (the saved states mean the same in both).
  std::vector<double> dq = buf(T * HD), dk = buf(T * HD), dv = buf(T * HD), dg = buf(T * HD), dbeta = buf(T * H);
  if (tp.recurrent_reference)
    kda::kda_recurrent_backward_f64(dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_o.data(),
                                    tp.states.data(), tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(),
                                    tp.beta.data(), d.scale, T, H, D, D, every);
  else
    kda::kda_chunk_backward_f64(dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_o.data(), tp.states.data(),
                                tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(), tp.beta.data(), d.scale, T, H, D, D,
                                every);

  // 4. Gate (kernels/kda/kda_f64.h), then z = fa Wfb^T, fa = x Wfa^T.
  std::vector<double> dz = buf(T * HD), dfa = buf(T * D);
  kda::gate_backward(dz.data(), G.alog, G.dt, dg.data(), tp.sg.data(), tp.z.data(), W.alog, W.dt, d.lower_bound, T, H,
                     D);
  linear_backward(dfa.data(), G.fb, dz.data(), tp.fa.data(), W.fb, T, D, HD, true);
  linear_backward(dx, G.fa, dfa.data(), x, W.fa, T, hid, D, true);

  // 3. beta = sigmoid(b_proj x): dlogit = dbeta beta (1 - beta).
  for (int64_t i = 0; i < T * H; ++i) dbeta[size_t(i)] *= tp.beta[size_t(i)] * (1.0 - tp.beta[size_t(i)]);
  linear_backward(dx, G.b, dbeta.data(), x, W.b, T, hid, H, true);

  // 2. L2 norms (in place: dq, dk become the gradients w.r.t. the SiLU outputs).
  kda::l2norm_backward(dq.data(), dq.data(), tp.q.data(), tp.q_inv.data(), T * H, D);
  kda::l2norm_backward(dk.data(), dk.data(), tp.k.data(), tp.k_inv.data(), T * H, D);

  // 1. Conv + SiLU, then the projections.
  std::vector<double> dp = buf(T * HD);
  kda::conv_silu_backward(dp.data(), G.qc, dq.data(), tp.qc.data(), tp.qp.data(), T, HD, W.qc, d.K);
  linear_backward(dx, G.q, dp.data(), x, W.q, T, hid, HD, true);
  kda::conv_silu_backward(dp.data(), G.kc, dk.data(), tp.kc.data(), tp.kp.data(), T, HD, W.kc, d.K);
  linear_backward(dx, G.k, dp.data(), x, W.k, T, hid, HD, true);
  kda::conv_silu_backward(dp.data(), G.vc, dv.data(), tp.vc.data(), tp.vp.data(), T, HD, W.vc, d.K);
  linear_backward(dx, G.v, dp.data(), x, W.v, T, hid, HD, true);
}

}  // namespace k3::train
