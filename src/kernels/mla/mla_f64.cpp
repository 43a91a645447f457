#include "kernels/mla/mla_f64.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace k3::mla {

namespace {

// Scaled causal scores of query row t of head h: out[s] = scale·(q_nope·k_nope(s) + q_rot·k_rot(s)),
// s = 0..last (the query's position).
void head_scores(double* out, const double* q, int64_t ldq, const double* kv, int64_t ldkv, const double* k_rot,
                 int64_t ldr, const Dims& d, int64_t h, int64_t t, int64_t last, double scale) {
  const int64_t dq = d.Dn + d.Dr, dkv = d.Dn + d.Dv;
  const double* qt = q + t * ldq + h * dq;  // [q_nope | q_rot]
  for (int64_t s = 0; s <= last; ++s) {
    const double* kn = kv + s * ldkv + h * dkv;
    const double* kr = k_rot + s * ldr;
    double acc = 0.0;
    for (int64_t j = 0; j < d.Dn; ++j) acc += qt[j] * kn[j];
    for (int64_t j = 0; j < d.Dr; ++j) acc += qt[d.Dn + j] * kr[j];
    out[s] = acc * scale;
  }
}

double sigmoid(double z) {  // split by sign so exp never overflows
  if (z >= 0) return 1.0 / (1.0 + std::exp(-z));
  const double e = std::exp(z);
  return e / (1.0 + e);
}

}  // namespace

void attention_forward_f64(double* o, int64_t ldo, double* lse, const double* q, int64_t ldq, const double* kv,
                           int64_t ldkv, const double* k_rot, int64_t ldr, int64_t T, const Dims& d, double scale,
                           int64_t past) {
  const int64_t dkv = d.Dn + d.Dv;
  std::vector<double> pr(static_cast<size_t>(past + T));
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t last = past + t;  // the query's position: it attends to keys 0..last
      head_scores(pr.data(), q, ldq, kv, ldkv, k_rot, ldr, d, h, t, last, scale);
      double mx = -INFINITY;  // max-subtracted softmax over s = 0..last (causal)
      for (int64_t s = 0; s <= last; ++s) mx = std::max(mx, pr[size_t(s)]);
      double z = 0.0;
      for (int64_t s = 0; s <= last; ++s) z += (pr[size_t(s)] = std::exp(pr[size_t(s)] - mx));
      lse[h * T + t] = mx + std::log(z);
      // o_t = Σ_s P_ts v_s, summed into a zeroed row in order s = 0..last.
      double* orow = o + t * ldo + h * d.Dv;
      std::fill(orow, orow + d.Dv, 0.0);
      for (int64_t s = 0; s <= last; ++s) {
        const double w = pr[size_t(s)] / z;
        const double* v = kv + s * ldkv + h * dkv + d.Dn;
        for (int64_t j = 0; j < d.Dv; ++j) orow[j] += w * v[j];
      }
    }
  }
}

void attention_backward_f64(double* dq, int64_t lddq, double* dkv, int64_t lddkv, double* dk_rot, int64_t lddr,
                            const double* dO, int64_t lddo, const double* q, int64_t ldq, const double* kv,
                            int64_t ldkv, const double* k_rot, int64_t ldr, const double* lse, int64_t T, const Dims& d,
                            double scale) {
  const int64_t wq = d.Dn + d.Dr, wkv = d.Dn + d.Dv;
  for (int64_t t = 0; t < T; ++t) {
    std::fill(dq + t * lddq, dq + t * lddq + d.H * wq, 0.0);
    std::fill(dkv + t * lddkv, dkv + t * lddkv + d.H * wkv, 0.0);
    std::fill(dk_rot + t * lddr, dk_rot + t * lddr + d.Dr, 0.0);
  }
  std::vector<double> dProw(static_cast<size_t>(T)), prow(static_cast<size_t>(T));
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      // P_ts = exp(S_ts - lse_t), recomputed from the saved log-sum-exp.
      double* pr = prow.data();
      head_scores(pr, q, ldq, kv, ldkv, k_rot, ldr, d, h, t, t, scale);
      for (int64_t s = 0; s <= t; ++s) pr[s] = std::exp(pr[s] - lse[h * T + t]);
      const double* dot = dO + t * lddo + h * d.Dv;
      double sum = 0.0;  // Σ_s P_ts dP_ts
      for (int64_t s = 0; s <= t; ++s) {
        const double* v = kv + s * ldkv + h * wkv + d.Dn;
        double* dv = dkv + s * lddkv + h * wkv + d.Dn;
        double a = 0.0;
        for (int64_t j = 0; j < d.Dv; ++j) {
          a += dot[j] * v[j];
          dv[j] += pr[s] * dot[j];
        }
        dProw[size_t(s)] = a;
        sum += pr[s] * a;
      }
      const double* qt = q + t * ldq + h * wq;
      double* dqt = dq + t * lddq + h * wq;
      for (int64_t s = 0; s <= t; ++s) {
        const double ds = pr[s] * (dProw[size_t(s)] - sum) * scale;
        const double* kn = kv + s * ldkv + h * wkv;
        const double* kr = k_rot + s * ldr;
        double* dkn = dkv + s * lddkv + h * wkv;
        double* dkr = dk_rot + s * lddr;  // k_rot is shared by the heads: its gradient sums over h
        for (int64_t j = 0; j < d.Dn; ++j) {
          dqt[j] += ds * kn[j];
          dkn[j] += ds * qt[j];
        }
        for (int64_t j = 0; j < d.Dr; ++j) {
          dqt[d.Dn + j] += ds * kr[j];
          dkr[j] += ds * qt[d.Dn + j];
        }
      }
    }
  }
}

void output_gate_forward_f64(double* og, double* gate, const double* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = sigmoid(gate[i]);
    og[i] = o[i] * gate[i];
  }
}

void output_gate_backward_f64(double* d_o, double* dz, const double* dog, const double* o, const double* gate,
                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double s = gate[i];
    d_o[i] = dog[i] * s;
    dz[i] = dog[i] * o[i] * s * (1.0 - s);  // σ' = σ(1 - σ)
  }
}

}  // namespace k3::mla
