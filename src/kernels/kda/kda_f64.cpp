#include "kernels/kda/kda_f64.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/norm/norm.h"

namespace k3::kda {
namespace {

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }  // exp overflow -> 0, no NaN

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

void conv_silu_forward(double* pre, double* act, const double* in, int64_t T, int64_t C, const double* w, int64_t K,
                       const double* history) {
  const int64_t P = K - 1;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t ch = 0; ch < C; ++ch) {
      double acc = 0.0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t s = t - P + j;
        if (s >= 0) acc += w[ch * K + j] * in[s * C + ch];
        else if (history) acc += w[ch * K + j] * history[(P + s) * C + ch];
      }
      pre[t * C + ch] = acc;
      act[t * C + ch] = acc * sigmoid(acc);
    }
  }
}

// d_pre = d_act * SiLU'(pre), SiLU'(p) = s (1 + p (1 - s)), s = sigmoid(p). Then pre[t,c] =
// sum_j w[c,j] in[t-P+j,c] gives dw[c,j] += sum_t d_pre[t,c] in[t-P+j,c] and d_in[s,c] = sum_j w[c,j] d_pre[s+P-j,c].
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

void gate_forward(double* g, double* sg, const double* z, const double* A_log, const double* dt_bias,
                  double lower_bound, int64_t T, int64_t H, int64_t D) {
  const int64_t HD = H * D;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double a = std::exp(A_log[h]);
      for (int64_t e = 0; e < D; ++e) {
        const int64_t i = t * HD + h * D + e;
        sg[i] = sigmoid(a * (z[i] + dt_bias[h * D + e]));
        g[i] = lower_bound * sg[i];
      }
    }
}

// g = lb * s, s = sigmoid(m), m = A (z + dt_bias), A = exp(A_log[h]):
//   dm = lb dg s (1 - s);  dz = A dm;  d dt_bias += A dm;  dA_log[h] += sum dm (z + dt_bias) A  (dA/dA_log = A).
void gate_backward(double* dz, double* dA_log, double* ddt_bias, const double* dg, const double* sg, const double* z,
                   const double* A_log, const double* dt_bias, double lower_bound, int64_t T, int64_t H, int64_t D) {
  const int64_t HD = H * D;
  for (int64_t h = 0; h < H; ++h) {
    const double A = std::exp(A_log[h]);
    double dalog = 0.0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < D; ++e) {
        const int64_t i = t * HD + h * D + e;
        const double s = sg[i];
        const double dm = lower_bound * dg[i] * s * (1.0 - s);
        dz[i] = A * dm;
        ddt_bias[h * D + e] += A * dm;
        dalog += dm * (z[i] + dt_bias[h * D + e]) * A;
      }
    dA_log[h] += dalog;  // entries >= H (the release's padding) are unused and get no gradient
  }
}

void gated_rmsnorm_forward(double* on, double* inv, const double* o, const double* gp, const double* w, double eps,
                           int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    const double* orow = o + r * D;
    const double v = inv_rms_f64(orow, D, eps);
    inv[r] = v;
    for (int64_t e = 0; e < D; ++e) on[r * D + e] = orow[e] * v * w[e] * sigmoid(gp[r * D + e]);
  }
}

// on = n * w * s, n = o * inv, s = sigmoid(gp):
//   dw += don n s;  dgp = don n w s (1 - s);  dn = don w s;  do = inv (dn - n mean(dn n)).
void gated_rmsnorm_backward(double* d_o, double* dgp, double* dw, const double* don, const double* o, const double* inv,
                            const double* gp, const double* w, int64_t rows, int64_t D) {
  std::vector<double> dn(static_cast<size_t>(D));
  for (int64_t r = 0; r < rows; ++r) {
    const double v = inv[r];
    double mean_dn_n = 0.0;
    for (int64_t e = 0; e < D; ++e) {
      const int64_t i = r * D + e;
      const double n = o[i] * v, s = sigmoid(gp[i]), dd = don[i];
      dw[e] += dd * n * s;
      dgp[i] = dd * n * w[e] * s * (1.0 - s);
      dn[size_t(e)] = dd * w[e] * s;
      mean_dn_n += dn[size_t(e)] * n;
    }
    mean_dn_n /= double(D);
    for (int64_t e = 0; e < D; ++e) {
      const int64_t i = r * D + e;
      d_o[i] = v * (dn[size_t(e)] - o[i] * v * mean_dn_n);
    }
  }
}

void l2norm_forward(double* out, double* inv, const double* in, int64_t rows, int64_t D, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += in[r * D + d] * in[r * D + d];
    inv[r] = 1.0 / std::sqrt(ss + eps);
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = in[r * D + d] * inv[r];
  }
}

// d_in = inv (d_out - out (out . d_out)): d inv / d in_i = -inv^3 in_i, and in * inv^3 (in . d_out) =
// inv out (out . d_out).
void l2norm_backward(double* d_in, const double* d_out, const double* out, const double* inv, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) dot += out[r * D + d] * d_out[r * D + d];
    for (int64_t d = 0; d < D; ++d) d_in[r * D + d] = inv[r] * (d_out[r * D + d] - out[r * D + d] * dot);
  }
}

// Recurrence per head from S = 0; o_t = S_t^T (scale q_t) reads the updated state. S_{t-1} is saved at
// every state_every-th token for the backward.
void kda_recurrent_forward_f64(double* o, double* states, const double* q, const double* k, const double* v,
                               const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                               int64_t Dv, int64_t state_every, double* state) {
  K3_CHECK(T >= 0 && H >= 1 && Dk >= 1 && Dv >= 1 && state_every >= 1, "kda_recurrent_forward_f64: bad sizes T ", T,
           ", H ", H, ", Dk ", Dk, ", Dv ", Dv, ", state_every ", state_every);
  const int64_t HDk = H * Dk, HDv = H * Dv, DD = Dk * Dv;
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    std::vector<double> S(static_cast<size_t>(DD), 0.0), u(static_cast<size_t>(Dv)), delta(static_cast<size_t>(Dv));
    if (state) std::copy_n(state + h * DD, DD, S.begin());
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
    if (state) std::copy(S.begin(), S.end(), state + h * DD);
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
  K3_CHECK(T >= 0 && H >= 1 && Dk >= 1 && Dv >= 1 && every >= 1, "kda_recurrent_backward_f64: bad sizes T ", T, ", H ",
           H, ", Dk ", Dk, ", Dv ", Dv, ", state_every ", every);
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
          for (int64_t j = 0; j < Dv; ++j)
            St[size_t(cc * Dv + j)] = Sp[size_t(cc * Dv + j)] + kt[cc] * delta[size_t(j)];
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

}  // namespace k3::kda
