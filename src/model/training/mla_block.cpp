// Gated MLA block, training forward/backward in float64 (see mla_block.h for the math).
//
// Notation: T tokens, hidden D, H heads, Dn/Dr/Dv head dims, R = kv_lora_rank, Qr = q_lora_rank,
// dq = Dn + Dr (q/k width per head), dkv = Dn + Dv (kv_b output per head), ldc = R + Dr.
// A linear layer is y = x Wᵀ with W [out, in] (the release's layout), so its backward is
// dx = dy W and dW += dyᵀ x.
#include "model/training/mla_block.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/tensor_table.h"

namespace k3::train {

namespace {

struct Dims {
  int64_t D, H, Dn, Dr, Dv, R, Qr, dq, dkv, ldc;
  bool gated;
};

Dims dims_of(const K3Config& c) {
  Dims d{};
  d.D = c.hidden_size;
  d.H = c.num_attention_heads;
  d.Dn = c.qk_nope_head_dim;
  d.Dr = c.qk_rope_head_dim;
  d.Dv = c.v_head_dim;
  d.R = c.kv_lora_rank;
  d.Qr = c.q_lora_rank;
  d.dq = d.Dn + d.Dr;
  d.dkv = d.Dn + d.Dv;
  d.ldc = d.R + d.Dr;
  d.gated = c.mla_use_output_gate;
  if (d.D <= 0 || d.H <= 0 || d.Dn < 0 || d.Dr < 0 || d.Dv <= 0 || d.R <= 0 || d.Qr < 0 || d.dq <= 0)
    fail(c.source,
         ": MLA training block needs positive hidden_size, num_attention_heads, v_head_dim, kv_lora_rank "
         "and qk head dims");
  return d;
}

// Parameter names and their expected sizes (p()/g() check the element count and name the tensor).
struct Names {
  std::string q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, g, o;
};
Names names_of(const std::string& prefix) {
  using K = TensorKind;
  auto n = [&](K kind) { return tensor_name_at(prefix, kind); };
  return {n(K::MlaQA),      n(K::MlaQANorm), n(K::MlaQB), n(K::MlaQ), n(K::MlaKvA),
          n(K::MlaKvANorm), n(K::MlaKvB),    n(K::MlaG),  n(K::MlaO)};
}

void check_layer(const K3Config& c, int64_t layer) {
  if (layer >= 0 && layer < int64_t(c.layer_kind.size()) && c.layer_kind[size_t(layer)] != AttnKind::MLA)
    fail(c.source, ": layer ", layer, " is not an MLA layer");
}

// y[T, out] = x[T, in] Wᵀ   (W [out, in]); ldx/ldy are row strides.
void linear_fwd(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t T, int64_t out,
                int64_t in) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(out), int(in), 1.0, x, int(ldx), W, int(in), 0.0, y,
              int(ldy));
}
// dx[T, in] (= or +=, by beta) dy[T, out] W   — gradient of the input of y = x Wᵀ.
void linear_bwd_x(double* dx, int64_t lddx, const double* dy, int64_t lddy, const double* W, int64_t T, int64_t out,
                  int64_t in, double beta) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(T), int(in), int(out), 1.0, dy, int(lddy), W, int(in),
              beta, dx, int(lddx));
}
// dW[out, in] += dy[T, out]ᵀ x[T, in]   — gradient of the weight of y = x Wᵀ.
void linear_bwd_w(double* dW, const double* dy, int64_t lddy, const double* x, int64_t ldx, int64_t T, int64_t out,
                  int64_t in) {
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(T), 1.0, dy, int(lddy), x, int(ldx), 1.0,
              dW, int(in));
}

// RMSNorm of row t (n columns of x with stride ldx): xhat = x * r, r = 1/sqrt(mean(x²) + eps),
// y = w ⊙ xhat. Saves xhat and r for the backward.
void rmsnorm_fwd(double* y, double* xhat, double* rs, const double* x, int64_t ldx, const double* w, double eps,
                 int64_t T, int64_t n) {
  for (int64_t t = 0; t < T; ++t) {
    const double* xr = x + t * ldx;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const double r = 1.0 / std::sqrt(ss / double(n) + eps);
    rs[t] = r;
    for (int64_t i = 0; i < n; ++i) {
      xhat[t * n + i] = xr[i] * r;
      y[t * n + i] = w[i] * xhat[t * n + i];
    }
  }
}

// Backward of y = w ⊙ (x r): dw += Σ_t dy ⊙ xhat; with g = dy ⊙ w,
//   dx_k = r g_k - r³ x_k / n Σ_i g_i x_i = r (g_k - xhat_k · mean(g ⊙ xhat))
// (dr/dx_k = -r³ x_k / n). dx is written (not accumulated) into rows of stride lddx.
void rmsnorm_bwd(double* dx, int64_t lddx, double* dw, const double* dy, const double* xhat, const double* rs,
                 const double* w, int64_t T, int64_t n) {
  std::vector<double> g(static_cast<size_t>(n));
  for (int64_t t = 0; t < T; ++t) {
    const double* dyr = dy + t * n;
    const double* xh = xhat + t * n;
    double dot = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      dw[i] += dyr[i] * xh[i];
      g[size_t(i)] = dyr[i] * w[i];
      dot += g[size_t(i)] * xh[i];
    }
    const double m = dot / double(n);
    for (int64_t i = 0; i < n; ++i) dx[t * lddx + i] = rs[t] * (g[size_t(i)] - xh[i] * m);
  }
}

// Scaled causal scores of query row t of head h: out[s] = scale·(q_nope·k_nope(s) + q_rot·k_rot(s)),
// s = 0..t. Keys: k_nope from kv (per head), k_rot from columns R..R+Dr of ckv (shared by all heads).
void head_scores(double* out, const double* q, const double* kv, const double* ckv, const Dims& d, int64_t h, int64_t t,
                 double scale) {
  const double* qt = q + t * d.H * d.dq + h * d.dq;  // [q_nope | q_rot]
  for (int64_t s = 0; s <= t; ++s) {
    const double* kn = kv + s * d.H * d.dkv + h * d.dkv;
    const double* kr = ckv + s * d.ldc + d.R;
    double acc = 0.0;
    for (int64_t j = 0; j < d.Dn; ++j) acc += qt[j] * kn[j];
    for (int64_t j = 0; j < d.Dr; ++j) acc += qt[d.Dn + j] * kr[j];
    out[s] = acc * scale;
  }
}

double sigmoid(double z) {
  if (z >= 0) return 1.0 / (1.0 + std::exp(-z));
  const double e = std::exp(z);
  return e / (1.0 + e);
}

}  // namespace

void mla_block_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, MlaBlockTape* tape) {
  check_layer(c, layer);
  const Dims d = dims_of(c);
  const Names n = names_of(prefix);
  if (T <= 0) fail("mla_block_forward: T must be positive, got ", T);
  const double eps = double(c.mla_norm_eps);
  const double scale = 1.0 / std::sqrt(double(d.dq));  // q_head_dim^-0.5 (§5.4 step 4)
  const size_t sT = static_cast<size_t>(T);

  MlaBlockTape local;
  MlaBlockTape& tp = tape ? *tape : local;
  tp = MlaBlockTape{};
  tp.T = T;
  tp.x.assign(x, x + T * d.D);

  // 1. q = q_b(RMSNorm(q_a x)) or q_proj x.   [T, H*dq]
  tp.q.assign(sT * size_t(d.H * d.dq), 0.0);
  if (d.Qr > 0) {
    std::vector<double> qa_raw(sT * size_t(d.Qr));
    linear_fwd(qa_raw.data(), d.Qr, x, d.D, P.p(n.q_a, d.Qr * d.D), T, d.Qr, d.D);
    tp.qa_hat.assign(qa_raw.size(), 0.0);
    tp.qa.assign(qa_raw.size(), 0.0);
    tp.qa_rs.assign(sT, 0.0);
    rmsnorm_fwd(tp.qa.data(), tp.qa_hat.data(), tp.qa_rs.data(), qa_raw.data(), d.Qr, P.p(n.q_a_norm, d.Qr), eps, T,
                d.Qr);
    linear_fwd(tp.q.data(), d.H * d.dq, tp.qa.data(), d.Qr, P.p(n.q_b, d.H * d.dq * d.Qr), T, d.H * d.dq, d.Qr);
  } else {
    linear_fwd(tp.q.data(), d.H * d.dq, x, d.D, P.p(n.q, d.H * d.dq * d.D), T, d.H * d.dq, d.D);
  }

  // 2. c = kv_a x = [c_lat | k_rot]; lat = RMSNorm(c_lat). k_rot stays raw (no norm, no rotation).
  tp.ckv.assign(sT * size_t(d.ldc), 0.0);
  linear_fwd(tp.ckv.data(), d.ldc, x, d.D, P.p(n.kv_a, d.ldc * d.D), T, d.ldc, d.D);
  tp.lat_hat.assign(sT * size_t(d.R), 0.0);
  tp.lat.assign(sT * size_t(d.R), 0.0);
  tp.lat_rs.assign(sT, 0.0);
  rmsnorm_fwd(tp.lat.data(), tp.lat_hat.data(), tp.lat_rs.data(), tp.ckv.data(), d.ldc, P.p(n.kv_a_norm, d.R), eps, T,
              d.R);

  // 3. kv = kv_b(lat): per head [k_nope (Dn) | v (Dv)].   [T, H*dkv]
  tp.kv.assign(sT * size_t(d.H * d.dkv), 0.0);
  linear_fwd(tp.kv.data(), d.H * d.dkv, tp.lat.data(), d.R, P.p(n.kv_b, d.H * d.dkv * d.R), T, d.H * d.dkv, d.R);

  // 4-5. Per head: causal softmax of scaled scores, o = P v.
  const int64_t ldkv = d.H * d.dkv, ldo = d.H * d.Dv;
  tp.lse.assign(size_t(d.H) * sT, 0.0);
  tp.o.assign(sT * size_t(ldo), 0.0);
  std::vector<double> pr(sT);
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      head_scores(pr.data(), tp.q.data(), tp.kv.data(), tp.ckv.data(), d, h, t, scale);
      double mx = -INFINITY;  // max-subtracted softmax over s = 0..t (causal)
      for (int64_t s = 0; s <= t; ++s) mx = std::max(mx, pr[size_t(s)]);
      double z = 0.0;
      for (int64_t s = 0; s <= t; ++s) z += (pr[size_t(s)] = std::exp(pr[size_t(s)] - mx));
      tp.lse[size_t(h * T + t)] = mx + std::log(z);
      double* orow = tp.o.data() + t * ldo + h * d.Dv;
      for (int64_t s = 0; s <= t; ++s) {
        const double w = pr[size_t(s)] / z;
        const double* v = tp.kv.data() + s * ldkv + h * d.dkv + d.Dn;
        for (int64_t j = 0; j < d.Dv; ++j) orow[j] += w * v[j];
      }
    }
  }

  // Output gate: og = o ⊙ sigmoid(g_proj x) (full rank, per channel), then y = o_proj og.
  if (d.gated) {
    tp.gate.assign(sT * size_t(ldo), 0.0);
    linear_fwd(tp.gate.data(), ldo, x, d.D, P.p(n.g, ldo * d.D), T, ldo, d.D);
    tp.og.resize(tp.o.size());
    for (size_t i = 0; i < tp.o.size(); ++i) {
      tp.gate[i] = sigmoid(tp.gate[i]);
      tp.og[i] = tp.o[i] * tp.gate[i];
    }
  } else {
    tp.og = tp.o;
  }
  linear_fwd(y, d.D, tp.og.data(), ldo, P.p(n.o, d.D * ldo), T, d.D, ldo);
}

void mla_block_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                        const MlaBlockTape& tp, const double* dy, double* dx) {
  check_layer(c, layer);
  const Dims d = dims_of(c);
  const Names n = names_of(prefix);
  const int64_t T = tp.T;
  if (T <= 0 || int64_t(tp.x.size()) != T * d.D || int64_t(tp.lse.size()) != d.H * T)
    fail("mla_block_backward: tape is empty or from another config");
  const double scale = 1.0 / std::sqrt(double(d.dq));
  const size_t sT = static_cast<size_t>(T);
  const int64_t ldq = d.H * d.dq, ldkv = d.H * d.dkv, ldo = d.H * d.Dv;
  const double* x = tp.x.data();

  // y = og Woᵀ:  dWo += dyᵀ og;  dog = dy Wo.
  std::vector<double> dog(sT * size_t(ldo));
  linear_bwd_w(P.g(n.o, d.D * ldo), dy, d.D, tp.og.data(), ldo, T, d.D, ldo);
  linear_bwd_x(dog.data(), ldo, dy, d.D, P.p(n.o, d.D * ldo), T, d.D, ldo, 0.0);

  // Gate: og = o ⊙ σ(zg), zg = x Wgᵀ.  do = dog ⊙ σ;  dzg = dog ⊙ o ⊙ σ(1-σ);  dWg += dzgᵀ x; dx = dzg Wg.
  // dx is first written here (beta 0) or by the first input-gradient term below.
  std::vector<double> dO(sT * size_t(ldo));
  bool dx_written = false;
  if (d.gated) {
    std::vector<double> dz(dO.size());
    for (size_t i = 0; i < dO.size(); ++i) {
      const double s = tp.gate[i];
      dO[i] = dog[i] * s;
      dz[i] = dog[i] * tp.o[i] * s * (1.0 - s);
    }
    linear_bwd_w(P.g(n.g, ldo * d.D), dz.data(), ldo, x, d.D, T, ldo, d.D);
    linear_bwd_x(dx, d.D, dz.data(), ldo, P.p(n.g, ldo * d.D), T, ldo, d.D, 0.0);
    dx_written = true;
  } else {
    dO = dog;
  }

  // Attention, per head. With S = scale·(q·k), P = softmax_causal(S), o_t = Σ_s P_ts v_s:
  //   dP_ts = do_t · v_s;  dv_s += Σ_t P_ts do_t;
  //   dS_ts = P_ts (dP_ts - Σ_s' P_ts' dP_ts')          (softmax Jacobian; 0 where masked)
  //   dq_t += scale Σ_s dS_ts k_s;  dk_s += scale Σ_t dS_ts q_t
  // with k_s = [k_nope_h(s) | k_rot(s)]; k_rot is shared by the heads, so its gradient sums over h.
  std::vector<double> dq(sT * size_t(ldq), 0.0), dkv(sT * size_t(ldkv), 0.0), dckv(sT * size_t(d.ldc), 0.0);
  std::vector<double> dProw(sT), prow(sT);
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      // P_ts = exp(S_ts - lse_t), recomputed from the saved log-sum-exp.
      double* pr = prow.data();
      head_scores(pr, tp.q.data(), tp.kv.data(), tp.ckv.data(), d, h, t, scale);
      for (int64_t s = 0; s <= t; ++s) pr[s] = std::exp(pr[s] - tp.lse[size_t(h * T + t)]);
      const double* dot = dO.data() + t * ldo + h * d.Dv;
      double sum = 0.0;  // Σ_s P_ts dP_ts
      for (int64_t s = 0; s <= t; ++s) {
        const double* v = tp.kv.data() + s * ldkv + h * d.dkv + d.Dn;
        double* dv = dkv.data() + s * ldkv + h * d.dkv + d.Dn;
        double a = 0.0;
        for (int64_t j = 0; j < d.Dv; ++j) {
          a += dot[j] * v[j];
          dv[j] += pr[s] * dot[j];
        }
        dProw[size_t(s)] = a;
        sum += pr[s] * a;
      }
      const double* qt = tp.q.data() + t * ldq + h * d.dq;
      double* dqt = dq.data() + t * ldq + h * d.dq;
      for (int64_t s = 0; s <= t; ++s) {
        const double ds = pr[s] * (dProw[size_t(s)] - sum) * scale;
        const double* kn = tp.kv.data() + s * ldkv + h * d.dkv;
        const double* kr = tp.ckv.data() + s * d.ldc + d.R;
        double* dkn = dkv.data() + s * ldkv + h * d.dkv;
        double* dkr = dckv.data() + s * d.ldc + d.R;
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

  // kv = lat Wkvbᵀ:  dWkvb += dkvᵀ lat;  dlat = dkv Wkvb.
  std::vector<double> dlat(sT * size_t(d.R));
  linear_bwd_w(P.g(n.kv_b, ldkv * d.R), dkv.data(), ldkv, tp.lat.data(), d.R, T, ldkv, d.R);
  linear_bwd_x(dlat.data(), d.R, dkv.data(), ldkv, P.p(n.kv_b, ldkv * d.R), T, ldkv, d.R, 0.0);
  // lat = RMSNorm(c_lat): its input gradient fills columns 0..R of dckv (k_rot columns hold the attention term).
  rmsnorm_bwd(dckv.data(), d.ldc, P.g(n.kv_a_norm, d.R), dlat.data(), tp.lat_hat.data(), tp.lat_rs.data(),
              P.p(n.kv_a_norm, d.R), T, d.R);
  // ckv = x Wkvaᵀ.
  linear_bwd_w(P.g(n.kv_a, d.ldc * d.D), dckv.data(), d.ldc, x, d.D, T, d.ldc, d.D);
  linear_bwd_x(dx, d.D, dckv.data(), d.ldc, P.p(n.kv_a, d.ldc * d.D), T, d.ldc, d.D, dx_written ? 1.0 : 0.0);

  // q path.
  if (d.Qr > 0) {
    // q = qa Wqbᵀ;  qa = RMSNorm(qa_raw);  qa_raw = x Wqaᵀ.
    std::vector<double> dqa(sT * size_t(d.Qr)), dqa_raw(sT * size_t(d.Qr));
    linear_bwd_w(P.g(n.q_b, ldq * d.Qr), dq.data(), ldq, tp.qa.data(), d.Qr, T, ldq, d.Qr);
    linear_bwd_x(dqa.data(), d.Qr, dq.data(), ldq, P.p(n.q_b, ldq * d.Qr), T, ldq, d.Qr, 0.0);
    rmsnorm_bwd(dqa_raw.data(), d.Qr, P.g(n.q_a_norm, d.Qr), dqa.data(), tp.qa_hat.data(), tp.qa_rs.data(),
                P.p(n.q_a_norm, d.Qr), T, d.Qr);
    linear_bwd_w(P.g(n.q_a, d.Qr * d.D), dqa_raw.data(), d.Qr, x, d.D, T, d.Qr, d.D);
    linear_bwd_x(dx, d.D, dqa_raw.data(), d.Qr, P.p(n.q_a, d.Qr * d.D), T, d.Qr, d.D, 1.0);
  } else {
    linear_bwd_w(P.g(n.q, ldq * d.D), dq.data(), ldq, x, d.D, T, ldq, d.D);
    linear_bwd_x(dx, d.D, dq.data(), ldq, P.p(n.q, ldq * d.D), T, ldq, d.D, 1.0);
  }
}

}  // namespace k3::train
