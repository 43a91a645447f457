// KDA attention block, training forward and backward in float64. See kda_block.h for the math and
// src/model/kda_layer.cpp + src/kernels/kda/kda_cpu.cpp for the inference twin this must match.
//
// Notation in the comments: x [T, hidden] is the block input; for any forward quantity a, "da" is the
// gradient of the loss w.r.t. a. A projection a = x W^T (W [out, in]) has the backward
// dW += da^T x and dx += da W.
#include "train/kda_block.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "model/tensor_table.h"
#include "train/kda_chunk.h"

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
  K3_CHECK(d.hid >= 1 && d.H >= 1 && d.D >= 1 && d.K >= 1, "kda_block: bad dimensions in ", c.source,
           ": hidden ", d.hid, ", heads ", d.H, ", head_dim ", d.D, ", short_conv_kernel_size ", d.K);
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

// y[T, out] = x[T, in] W^T, W [out, in].
void linear(double* y, const double* x, int64_t T, const double* W, int64_t out, int64_t in) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(out), int(in), 1.0, x, int(in), W, int(in), 0.0, y,
              int(out));
}

// Backward of y = x W^T: dW += dy^T x, dx += dy W.
void linear_backward(const double* dy, const double* x, int64_t T, const double* W, double* dW, int64_t out,
                     int64_t in, double* dx) {
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(T), 1.0, dy, int(out), x, int(in), 1.0,
              dW, int(in));
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(T), int(in), int(out), 1.0, dy, int(out), W, int(in), 1.0,
              dx, int(in));
}

// Causal depthwise conv over T tokens of C channels, zero history: out[t,c] = sum_j w[c,j] in[t-(K-1)+j, c]
// (tap K-1 is the current token), then SiLU. pre = the conv output (SiLU input), act = SiLU(pre).
void conv_silu_forward(double* pre, double* act, const double* in, int64_t T, int64_t C, const double* w, int64_t K) {
  const int64_t P = K - 1;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t ch = 0; ch < C; ++ch) {
      double acc = 0.0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t s = t - P + j;
        if (s >= 0) acc += w[ch * K + j] * in[s * C + ch];
      }
      pre[t * C + ch] = acc;
      act[t * C + ch] = acc * sigmoid(acc);
    }
  }
}

// Backward of conv_silu_forward. d_act -> d_pre = d_act * SiLU'(pre), SiLU'(p) = s (1 + p (1 - s)), s = sigmoid(p).
// Then pre[t,c] = sum_j w[c,j] in[t-P+j,c] gives dw[c,j] += sum_t d_pre[t,c] in[t-P+j,c] and
// d_in[s,c] = sum_j w[c,j] d_pre[s+P-j,c]. d_in is overwritten.
void conv_silu_backward(double* d_in, double* dw, const double* d_act, const double* pre, const double* in, int64_t T,
                        int64_t C, const double* w, int64_t K) {
  const int64_t P = K - 1;
  std::vector<double> dpre(static_cast<size_t>(T * C));
  for (int64_t i = 0; i < T * C; ++i) {
    const double s = sigmoid(pre[i]);
    dpre[size_t(i)] = d_act[i] * s * (1.0 + pre[i] * (1.0 - s));
  }
  std::fill(d_in, d_in + T * C, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t ch = 0; ch < C; ++ch) {
      const double dp = dpre[size_t(t * C + ch)];
      for (int64_t j = 0; j < K; ++j) {
        const int64_t s = t - P + j;
        if (s < 0) continue;  // zero history: no parameter or input gradient
        dw[ch * K + j] += dp * in[s * C + ch];
        d_in[s * C + ch] += dp * w[ch * K + j];
      }
    }
}

// Per-head L2 norm: out = in * inv, inv = 1/sqrt(sum in^2 + eps), rows of D.
void l2norm_forward(double* out, double* inv, const double* in, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += in[r * D + d] * in[r * D + d];
    inv[r] = 1.0 / std::sqrt(ss + kL2Eps);
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = in[r * D + d] * inv[r];
  }
}

// Backward of out = in / sqrt(|in|^2 + eps): d_in = inv (d_out - out (out . d_out)).
// (d inv / d in_i = -inv^3 in_i, and in * inv^3 (in . d_out) = inv out (out . d_out).) d_in may alias d_out.
void l2norm_backward(double* d_in, const double* d_out, const double* out, const double* inv, int64_t rows,
                     int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) dot += out[r * D + d] * d_out[r * D + d];
    for (int64_t d = 0; d < D; ++d) d_in[r * D + d] = inv[r] * (d_out[r * D + d] - out[r * D + d] * dot);
  }
}

// One token of the recurrence for one head, on a Dk x Dv key-major state S (S[c*Dv + j]):
//   S <- Diag(alpha) S;  u = S^T k;  delta = beta (v - u);  S <- S + k delta^T.
// u and delta are [Dv] scratch outputs (the backward needs them).
void recur_step(double* S, const double* k, const double* v, const double* g, double beta, double* u, double* delta,
                int64_t Dk, int64_t Dv) {
  for (int64_t j = 0; j < Dv; ++j) u[j] = 0.0;
  for (int64_t c = 0; c < Dk; ++c) {
    const double a = std::exp(g[c]);
    double* row = S + c * Dv;
    for (int64_t j = 0; j < Dv; ++j) {
      row[j] *= a;
      u[j] += k[c] * row[j];
    }
  }
  for (int64_t j = 0; j < Dv; ++j) delta[j] = beta * (v[j] - u[j]);
  for (int64_t c = 0; c < Dk; ++c) {
    double* row = S + c * Dv;
    for (int64_t j = 0; j < Dv; ++j) row[j] += k[c] * delta[j];
  }
}

}  // namespace

// Recurrence per head from S = 0; o_t = S_t^T (scale q_t) reads the updated state. S_{t-1} is saved at
// every state_every-th token for the backward.
void kda_recurrent_forward_f64(double* o, double* states, const double* q, const double* k, const double* v,
                               const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                               int64_t Dv, int64_t state_every) {
  K3_CHECK(T >= 0 && H >= 1 && Dk >= 1 && Dv >= 1 && state_every >= 1, "kda_recurrent_forward_f64: bad sizes T ", T,
           ", H ", H, ", Dk ", Dk, ", Dv ", Dv, ", state_every ", state_every);
  const int64_t HDk = H * Dk, HDv = H * Dv, DD = Dk * Dv;
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> S(static_cast<size_t>(DD), 0.0), u(static_cast<size_t>(Dv)), delta(static_cast<size_t>(Dv));
    for (int64_t t = 0; t < T; ++t) {
      if (states && t % state_every == 0) std::copy(S.begin(), S.end(), states + ((t / state_every) * H + h) * DD);
      const int64_t rk = t * HDk + h * Dk;
      recur_step(S.data(), k + rk, v + t * HDv + h * Dv, g + rk, beta[t * H + h], u.data(), delta.data(), Dk, Dv);
      double* ot = o + t * HDv + h * Dv;
      for (int64_t j = 0; j < Dv; ++j) ot[j] = 0.0;
      for (int64_t cc = 0; cc < Dk; ++cc) {
        const double sq = scale * q[rk + cc];
        for (int64_t j = 0; j < Dv; ++j) ot[j] += sq * S[size_t(cc * Dv + j)];
      }
    }
  }
}

// The recurrence, reversed. Per head, dS carries dL/dS_t from the future. Token t (S_{t-1} recomputed from
// the last saved state at or before t):
//   S' = Diag(a) S_{t-1}; u = S'^T k; delta = beta (v - u); S_t = S' + k delta^T; o = S_t^T (scale q)
// backward:
//   dq = scale S_t do;                 dS += scale q do^T            (o = S_t^T q~)
//   dk += dS delta; ddelta = dS^T k    (S_t = S' + k delta^T, dS' = dS)
//   dbeta = ddelta . (v - u); dv = beta ddelta; du = -beta ddelta
//   dS' += k du^T; dk += S' du         (u = S'^T k)
//   da[c] = sum_j dS'[c,j] S_{t-1}[c,j]; dS_{t-1} = Diag(a) dS'; dg = da * a   (a = exp(g))
void kda_recurrent_backward_f64(double* dq, double* dk, double* dv, double* dg, double* dbeta, const double* d_o,
                                const double* states, const double* q, const double* k, const double* v,
                                const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                                int64_t Dv, int64_t every) {
  K3_CHECK(T >= 0 && H >= 1 && Dk >= 1 && Dv >= 1 && every >= 1, "kda_recurrent_backward_f64: bad sizes T ", T,
           ", H ", H, ", Dk ", Dk, ", Dv ", Dv, ", state_every ", every);
  if (T == 0) return;
  K3_CHECK(states != nullptr, "kda_recurrent_backward_f64: states is null (the forward must save them)");
  const int64_t HDk = H * Dk, HDv = H * Dv, DD = Dk * Dv;
  std::fill(dk, dk + T * HDk, 0.0);
#pragma omp parallel for schedule(dynamic)
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> seg(static_cast<size_t>(every * DD));  // S_{t-1} for the tokens of one segment
    std::vector<double> dS(static_cast<size_t>(DD), 0.0), Sp(static_cast<size_t>(DD)), St(static_cast<size_t>(DD));
    std::vector<double> u(static_cast<size_t>(Dv)), delta(static_cast<size_t>(Dv)), ddelta(static_cast<size_t>(Dv)),
        du(static_cast<size_t>(Dv)), a(static_cast<size_t>(Dk));
    const int64_t n_seg = (T + every - 1) / every;
    for (int64_t sgi = n_seg - 1; sgi >= 0; --sgi) {
      const int64_t t0 = sgi * every, t1 = std::min(T, t0 + every);
      // Recompute S_{t-1} for t in [t0, t1) from the saved S_{t0-1}.
      std::vector<double> S(states + (sgi * H + h) * DD, states + (sgi * H + h + 1) * DD);
      for (int64_t t = t0; t < t1; ++t) {
        std::copy(S.begin(), S.end(), seg.begin() + (t - t0) * DD);
        if (t + 1 < t1) {
          const int64_t rk = t * HDk + h * Dk;
          recur_step(S.data(), k + rk, v + t * HDv + h * Dv, g + rk, beta[t * H + h], u.data(), delta.data(), Dk, Dv);
        }
      }
      for (int64_t t = t1 - 1; t >= t0; --t) {
        const int64_t rk = t * HDk + h * Dk, rv = t * HDv + h * Dv;
        const double* Sprev = &seg[size_t((t - t0) * DD)];
        const double *qt = q + rk, *kt = k + rk, *vt = v + rv, *gt = g + rk;
        const double* dot = d_o + rv;
        const double bt = beta[t * H + h];
        // Forward of this token again: S', u, delta, S_t.
        for (int64_t j = 0; j < Dv; ++j) u[size_t(j)] = 0.0;
        for (int64_t cc = 0; cc < Dk; ++cc) {
          a[size_t(cc)] = std::exp(gt[cc]);
          for (int64_t j = 0; j < Dv; ++j) {
            Sp[size_t(cc * Dv + j)] = a[size_t(cc)] * Sprev[cc * Dv + j];
            u[size_t(j)] += kt[cc] * Sp[size_t(cc * Dv + j)];
          }
        }
        for (int64_t j = 0; j < Dv; ++j) delta[size_t(j)] = bt * (vt[j] - u[size_t(j)]);
        for (int64_t cc = 0; cc < Dk; ++cc)
          for (int64_t j = 0; j < Dv; ++j) St[size_t(cc * Dv + j)] = Sp[size_t(cc * Dv + j)] + kt[cc] * delta[size_t(j)];
        // Output read: o = S_t^T (scale q).
        for (int64_t cc = 0; cc < Dk; ++cc) {
          double acc = 0.0;
          for (int64_t j = 0; j < Dv; ++j) {
            acc += St[size_t(cc * Dv + j)] * dot[j];
            dS[size_t(cc * Dv + j)] += scale * qt[cc] * dot[j];
          }
          dq[rk + cc] = scale * acc;
        }
        // Update S_t = S' + k delta^T.
        for (int64_t j = 0; j < Dv; ++j) ddelta[size_t(j)] = 0.0;
        for (int64_t cc = 0; cc < Dk; ++cc) {
          double acc = 0.0;
          for (int64_t j = 0; j < Dv; ++j) {
            acc += dS[size_t(cc * Dv + j)] * delta[size_t(j)];
            ddelta[size_t(j)] += dS[size_t(cc * Dv + j)] * kt[cc];
          }
          dk[rk + cc] += acc;
        }
        // delta = beta (v - u).
        double db = 0.0;
        for (int64_t j = 0; j < Dv; ++j) {
          db += ddelta[size_t(j)] * (vt[j] - u[size_t(j)]);
          dv[rv + j] = bt * ddelta[size_t(j)];
          du[size_t(j)] = -bt * ddelta[size_t(j)];
        }
        dbeta[t * H + h] = db;
        // u = S'^T k, then S' = Diag(a) S_{t-1}. dS becomes dS' and then dS_{t-1} in place.
        for (int64_t cc = 0; cc < Dk; ++cc) {
          double acc_k = 0.0, acc_a = 0.0;
          for (int64_t j = 0; j < Dv; ++j) {
            double& ds = dS[size_t(cc * Dv + j)];
            acc_k += Sp[size_t(cc * Dv + j)] * du[size_t(j)];
            ds += kt[cc] * du[size_t(j)];  // dS'
            acc_a += ds * Sprev[cc * Dv + j];
            ds *= a[size_t(cc)];  // dS_{t-1}
          }
          dk[rk + cc] += acc_k;
          dg[rk + cc] = acc_a * a[size_t(cc)];  // d exp(g)/dg = exp(g)
        }
      }
    }
  }
}

void kda_block_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, KdaBlockTape* tape) {
  const Dims d = dims_of(c, layer);
  const Names names(prefix);
  const auto W = resolve<const double*>(P, names, d, [&](const std::string& n, int64_t e) { return P.p(n, e); });
  K3_CHECK(T >= 0, "kda_block_forward: T must be >= 0, got ", T);
  const int64_t hid = d.hid, H = d.H, D = d.D, HD = d.HD;

  KdaBlockTape local;
  KdaBlockTape& tp = tape ? *tape : local;  // without a tape the intermediates live here and are dropped
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
  linear(tp.qp.data(), x, T, W.q, HD, hid);
  linear(tp.kp.data(), x, T, W.k, HD, hid);
  linear(tp.vp.data(), x, T, W.v, HD, hid);
  conv_silu_forward(tp.qc.data(), tp.qs.data(), tp.qp.data(), T, HD, W.qc, d.K);
  conv_silu_forward(tp.kc.data(), tp.ks.data(), tp.kp.data(), T, HD, W.kc, d.K);
  conv_silu_forward(tp.vc.data(), tp.v.data(), tp.vp.data(), T, HD, W.vc, d.K);

  // 2. Per-head L2 norm of q and k (v is not normalised).
  l2norm_forward(tp.q.data(), tp.q_inv.data(), tp.qs.data(), T * H, D);
  l2norm_forward(tp.k.data(), tp.k_inv.data(), tp.ks.data(), T * H, D);

  // 3. beta = sigmoid(b_proj x).
  linear(tp.beta.data(), x, T, W.b, H, hid);
  for (double& b : tp.beta) b = sigmoid(b);

  // 4. Gate: z = f_b(f_a x); g = lower_bound * sigmoid(exp(A_log[h]) (z + dt_bias)) (kernels/kda gate_forward).
  linear(tp.fa.data(), x, T, W.fa, D, hid);
  linear(tp.z.data(), tp.fa.data(), T, W.fb, HD, D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double a = std::exp(W.alog[h]);
      for (int64_t e = 0; e < D; ++e) {
        const int64_t i = t * HD + h * D + e;
        tp.sg[size_t(i)] = sigmoid(a * (tp.z[size_t(i)] + W.dt[h * D + e]));
        tp.g[size_t(i)] = d.lower_bound * tp.sg[size_t(i)];
      }
    }

  // 5. The recurrence (kda_chunk.h), chunked unless the tape asks for the recurrent reference twin. The
  // states entering every state_every-th token (= every chunk) are saved for the backward.
  double* states = n_ckpt > 0 ? tp.states.data() : nullptr;
  if (tp.recurrent_reference)
    kda_recurrent_forward_f64(tp.o.data(), states, tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(), tp.beta.data(),
                              d.scale, T, H, D, D, tp.state_every);
  else
    kda_chunk_forward_f64(tp.o.data(), states, tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(), tp.beta.data(),
                          d.scale, T, H, D, D, tp.state_every);

  // 6. Gated RMSNorm per head (weight shared by heads): on = o * inv * o_norm * sigmoid(g_proj x); y = o_proj on.
  linear(tp.gp.data(), x, T, W.g, HD, hid);
  for (int64_t r = 0; r < T * H; ++r) {
    const double* o = &tp.o[size_t(r * D)];
    double ss = 0.0;
    for (int64_t e = 0; e < D; ++e) ss += o[e] * o[e];
    const double inv = 1.0 / std::sqrt(ss / double(D) + d.norm_eps);
    tp.o_inv[size_t(r)] = inv;
    for (int64_t e = 0; e < D; ++e)
      tp.on[size_t(r * D + e)] = o[e] * inv * W.onorm[e] * sigmoid(tp.gp[size_t(r * D + e)]);
  }
  linear(y, tp.on.data(), T, W.o, hid, HD);
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
           "kda_block_backward: the tape (T = ", T, ") does not match the config of layer ", layer, " (", c.source, ")");
  const int64_t every = tp.state_every;
  K3_CHECK(every >= 1 && int64_t(tp.states.size()) == (T + every - 1) / every * H * D * D,
           "kda_block_backward: the tape holds no recurrent states (was kda_block_forward given this tape?)");
  std::fill(dx, dx + T * hid, 0.0);
  if (T == 0) return;
  const double* x = tp.x.data();
  auto buf = [](int64_t n) { return std::vector<double>(static_cast<size_t>(n), 0.0); };

  // 6. Output projection: y = on Wo^T.
  std::vector<double> don = buf(T * HD);
  {
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(hid), int(HD), int(T), 1.0, dy, int(hid), tp.on.data(),
                int(HD), 1.0, G.o, int(HD));  // dWo += dy^T on
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(T), int(HD), int(hid), 1.0, dy, int(hid), W.o, int(HD),
                0.0, don.data(), int(HD));  // don = dy Wo
  }
  // Gated RMSNorm: on = n * w * s, n = o * inv, s = sigmoid(gp).
  //   dw += don n s;  dgp = don n w s (1 - s);  dn = don w s;  do = inv (dn - n mean(dn n)).
  std::vector<double> dgp = buf(T * HD), d_o = buf(T * HD);
  for (int64_t r = 0; r < T * H; ++r) {
    const double inv = tp.o_inv[size_t(r)];
    std::vector<double> dn(static_cast<size_t>(D));
    double mean_dn_n = 0.0;
    for (int64_t e = 0; e < D; ++e) {
      const int64_t i = r * D + e;
      const double n = tp.o[size_t(i)] * inv, s = sigmoid(tp.gp[size_t(i)]), dd = don[size_t(i)];
      G.onorm[e] += dd * n * s;
      dgp[size_t(i)] = dd * n * W.onorm[e] * s * (1.0 - s);
      dn[size_t(e)] = dd * W.onorm[e] * s;
      mean_dn_n += dn[size_t(e)] * n;
    }
    mean_dn_n /= double(D);
    for (int64_t e = 0; e < D; ++e) {
      const int64_t i = r * D + e;
      d_o[size_t(i)] = inv * (dn[size_t(e)] - tp.o[size_t(i)] * inv * mean_dn_n);
    }
  }
  linear_backward(dgp.data(), x, T, W.g, G.g, HD, hid, dx);  // gp = g_proj x

  // 5. The recurrence, in the form the forward used (the saved states mean the same in both).
  std::vector<double> dq = buf(T * HD), dk = buf(T * HD), dv = buf(T * HD), dg = buf(T * HD), dbeta = buf(T * H);
  if (tp.recurrent_reference)
    kda_recurrent_backward_f64(dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_o.data(), tp.states.data(),
                               tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(), tp.beta.data(), d.scale, T, H, D, D,
                               every);
  else
    kda_chunk_backward_f64(dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_o.data(), tp.states.data(),
                           tp.q.data(), tp.k.data(), tp.v.data(), tp.g.data(), tp.beta.data(), d.scale, T, H, D, D,
                           every);

  // 4. Gate: g = lb * s, s = sigmoid(m), m = A (z + dt_bias), A = exp(A_log[h]).
  //   dm = lb dg s (1 - s);  dz = A dm;  d dt_bias += A dm;  dA_log[h] += sum dm (z + dt_bias) A  (dA/dA_log = A).
  std::vector<double> dz = buf(T * HD), dfa = buf(T * D);
  for (int64_t h = 0; h < H; ++h) {
    const double A = std::exp(W.alog[h]);
    double dalog = 0.0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < D; ++e) {
        const int64_t i = t * HD + h * D + e;
        const double s = tp.sg[size_t(i)];
        const double dm = d.lower_bound * dg[size_t(i)] * s * (1.0 - s);
        dz[size_t(i)] = A * dm;
        G.dt[h * D + e] += A * dm;
        dalog += dm * (tp.z[size_t(i)] + W.dt[h * D + e]) * A;
      }
    G.alog[h] += dalog;  // entries >= H (padding) are unused and get no gradient
  }
  // z = fa Wfb^T, fa = x Wfa^T.
  linear_backward(dz.data(), tp.fa.data(), T, W.fb, G.fb, HD, D, dfa.data());
  linear_backward(dfa.data(), x, T, W.fa, G.fa, D, hid, dx);

  // 3. beta = sigmoid(b_proj x): dlogit = dbeta beta (1 - beta).
  for (int64_t i = 0; i < T * H; ++i) dbeta[size_t(i)] *= tp.beta[size_t(i)] * (1.0 - tp.beta[size_t(i)]);
  linear_backward(dbeta.data(), x, T, W.b, G.b, H, hid, dx);

  // 2. L2 norms (in place: dq, dk become the gradients w.r.t. the SiLU outputs).
  l2norm_backward(dq.data(), dq.data(), tp.q.data(), tp.q_inv.data(), T * H, D);
  l2norm_backward(dk.data(), dk.data(), tp.k.data(), tp.k_inv.data(), T * H, D);

  // 1. Conv + SiLU, then the projections.
  std::vector<double> dp = buf(T * HD);
  conv_silu_backward(dp.data(), G.qc, dq.data(), tp.qc.data(), tp.qp.data(), T, HD, W.qc, d.K);
  linear_backward(dp.data(), x, T, W.q, G.q, HD, hid, dx);
  conv_silu_backward(dp.data(), G.kc, dk.data(), tp.kc.data(), tp.kp.data(), T, HD, W.kc, d.K);
  linear_backward(dp.data(), x, T, W.k, G.k, HD, hid, dx);
  conv_silu_backward(dp.data(), G.vc, dv.data(), tp.vc.data(), tp.vp.data(), T, HD, W.vc, d.K);
  linear_backward(dp.data(), x, T, W.v, G.v, HD, hid, dx);
}

}  // namespace k3::train
