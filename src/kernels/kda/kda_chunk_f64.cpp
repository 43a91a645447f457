// KDA recurrence core, chunked form, float64 forward and backward. See kda_chunk_f64.h for the contract and
// the forward math; this file explains the numerics and derives the backward.
//
// NUMERICS. The pair decays W_rs = exp(Gamma_r - Gamma_s) (s <= r) are never formed as a quotient
// exp(Gamma_r) / exp(Gamma_s): with g >= -5, Gamma reaches -5 C inside a chunk, so 1/exp(Gamma_s) = e^{5C}
// overflows double for C > 141 (and fp32 already for C > 17), giving inf * 0 = NaN. They are formed as the
// running product exp(Gamma_r - Gamma_s) = prod_{s < tau <= r} exp(g_tau), i.e. column s of the pair loop
// multiplies one per-token decay alpha_tau = exp(g_tau) in per step down r = s+1, s+2, ... That is the same
// number as exp of the difference (not an approximation), every factor is <= 1 for g <= 0 (so nothing can
// overflow for any chunk size), and it costs one exp per token and channel instead of one per pair and
// channel, which would dominate the chunk's time (docs/NUMERICS.md, "KDA"). It is also the order
// in which the recurrence itself applies the decays, so the two forms agree to ~n ulp rather than to the
// ~|Gamma| ulp that exp of a difference of two running sums near -80 would carry. exp(Gamma_r) itself is
// the running product from the chunk start. A factor that underflows is a term that has decayed away;
// with g >= -5 and C = 16 the smallest factor is e^-80 ~ 2e-35, far from double denormals.
//
// BACKWARD (per head and chunk; "dX" is dL/dX; dS is dL/dS_end, carried in from the next chunk, 0 after
// the last). Forward quantities are recomputed from the saved S0 (the same code as the forward). With
// E_r = exp(Gamma_r), Qt = E * Q, Kt = E * k, Kd_s = P_s * k_s where P_s = exp(Gamma_last - Gamma_s):
//   S_end = Diag(E_last) S0 + Kd^T U:   dS0 = Diag(E_last) dS;  dGamma_last += E_last * rowsum(S0 * dS);
//                                       dU += Kd dS;  dKd = U dS^T
//   O = Qt S0 + M U:                    dQt = dO S0^T;  dS0 += Qt^T dO;  dM = dO U^T;  dU += M^T dO
//   u_r = beta_r X_r, X_r = R_r - sum_{s<r} A_rs u_s (R = V - Kt S0). Reverse of the forward substitution,
//   r = n-1 down to 0 (this is dB = (I + diag(beta) A)^{-T} dU, solved by back substitution):
//                                       dB_r = dU_r - sum_{r'>r} A_r'r dX_r';  dX_r = beta_r dB_r;
//                                       dbeta_r = dB_r . X_r;  dA_rs = -dX_r . u_s (s < r)
//   R = V - Kt S0:                      dV = dX;  dKt = -dX S0^T;  dS0 -= Kt^T dX
//   Qt = E * Q, Kt = E * k:             dQ += dQt * E;  dk += dKt * E;  dGamma += dQt * Qt + dKt * Kt
//   Kd_s = P_s * k_s:                   dk_s += dKd_s * P_s;  dGamma_last += dKd_s * Kd_s;  dGamma_s -= dKd_s * Kd_s
//   M_rr = Q_r . k_r:                   dQ_r += dM_rr k_r;  dk_r += dM_rr Q_r
//   pairs s < r, with w = W_rs:         dQ_r += dM_rs k_s w;  dk_r += dA_rs k_s w;
//                                       dk_s += (dM_rs Q_r + dA_rs k_r) w;
//                                       x = (dM_rs Q_r + dA_rs k_r) k_s w:  dGamma_r += x;  dGamma_s -= x
// (the last line because dW_rs/dGamma_r = W_rs and dW_rs/dGamma_s = -W_rs). Finally Gamma_r = sum_{i<=r} g_i
// gives dg_i = sum_{r>=i} dGamma_r (a reverse cumulative sum inside the chunk), dq = scale dQ, and dS0
// becomes the dS of the previous chunk. The chunk-end terms (Diag(E_last) S0 and Kd) are what couple g to
// the later chunks.
//
// Cost per chunk of n tokens (multiply-adds): the forward recomputation (pair loop ~n^2 Dk, three
// n x Dk x Dv products, the solve ~n^2 Dv / 2) plus six n x Dk x Dv products, three n x n x Dv products,
// the back substitution and a second pair loop (~3 n^2 Dk). Per token that is ~9 Dk Dv against the
// recurrent backward's ~13 Dk Dv, and nearly all of it in register-tiled block products. The n x n x Dv
// products run over full n x n blocks with zeros above the diagonal: wasted work, but n <= 16 keeps it
// small and the calls simple.
#include "kernels/kda/kda_chunk_f64.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/gemm/tiled_f64.h"

namespace k3::kda {
namespace {

// Products: k3::gemm_acc_f64 (kernels/gemm/tiled_f64.h), not cblas_dgemm; its header says why (speed at
// these sizes, and a result independent of the OpenBLAS kernel set and thread count).
void gemm_nn(double* C, int64_t ldc, const double* A, int64_t lda, const double* B, int64_t ldb, int64_t m, int64_t nn,
             int64_t kk, double alpha) {
  gemm_acc_f64<false>(C, ldc, A, lda, B, ldb, m, nn, kk, alpha);
}
void gemm_tn(double* C, int64_t ldc, const double* A, int64_t lda, const double* B, int64_t ldb, int64_t m, int64_t nn,
             int64_t kk, double alpha) {
  gemm_acc_f64<true>(C, ldc, A, lda, B, ldb, m, nn, kk, alpha);
}
// dst[cols, rows] = src[rows, cols]^T (src row stride lds, dst row stride rows). Products with a
// transposed right operand transpose it first (it is small) and run gemm_nn.
void transpose(double* dst, const double* src, int64_t rows, int64_t cols, int64_t lds) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * lds + j];
}

struct Inputs {
  const double *q, *k, *v, *g, *beta;
  double scale;
  int64_t T, H, Dk, Dv;
};

void check_args(const char* fn, const Inputs& in, int64_t chunk) {
  K3_CHECK(in.T >= 0, fn, ": T must be >= 0, got ", in.T);
  K3_CHECK(in.H >= 1 && in.Dk >= 1 && in.Dv >= 1, fn, ": H, Dk, Dv must be >= 1, got ", in.H, ", ", in.Dk, ", ", in.Dv);
  K3_CHECK(chunk >= 1, fn, ": chunk must be >= 1, got ", chunk);
}

// The forward quantities of one chunk of one head, recomputed by the backward. Buffers are sized for a
// full chunk and reused; rows >= n are stale and never read.
struct ChunkForward {
  int64_t C, Dk, Dv;
  // [C, Dk] rows: Q = scale q, k, alpha = exp(g), E = exp(Gamma), Qt = E Q, Kt = E k,
  // P = exp(Gamma_last - Gamma), Kd = P k.
  std::vector<double> Q, K, alpha, E, Qt, Kt, P, Kd;
  std::vector<double> A, M;  // [C, C], row r column s; A strictly lower, M lower with diagonal, zeros elsewhere
  std::vector<double> X, U;  // [C, Dv]: X_r the residual before beta (see kda_chunk_f64.h), U = diag(beta) X
  std::vector<double> dec;   // [Dk] running decay product

  ChunkForward(int64_t C_, int64_t Dk_, int64_t Dv_)
      : C(C_),
        Dk(Dk_),
        Dv(Dv_),
        Q(size_t(C * Dk)),
        K(Q.size()),
        alpha(Q.size()),
        E(Q.size()),
        Qt(Q.size()),
        Kt(Q.size()),
        P(Q.size()),
        Kd(Q.size()),
        A(size_t(C * C)),
        M(A.size()),
        X(size_t(C * Dv)),
        U(X.size()),
        dec(size_t(Dk)) {}

  // Tokens t0 .. t0+n-1 of head h, entering state S0 [Dk, Dv].
  void compute(const Inputs& in, int64_t h, int64_t t0, int64_t n, const double* S0) {
    const int64_t HDk = in.H * Dk, HDv = in.H * Dv;
    // Gather Q, k, alpha; E = exp(Gamma) as the running product of alpha from the chunk start.
    double* dc = dec.data();
    for (int64_t c = 0; c < Dk; ++c) dc[c] = 1.0;
    for (int64_t r = 0; r < n; ++r) {
      const double* qr = in.q + (t0 + r) * HDk + h * Dk;
      const double* kr = in.k + (t0 + r) * HDk + h * Dk;
      const double* gr = in.g + (t0 + r) * HDk + h * Dk;
      double *Qr = &Q[size_t(r * Dk)], *Kr = &K[size_t(r * Dk)], *ar = &alpha[size_t(r * Dk)];
      double *Er = &E[size_t(r * Dk)], *Qtr = &Qt[size_t(r * Dk)], *Ktr = &Kt[size_t(r * Dk)];
      for (int64_t c = 0; c < Dk; ++c) {
        Qr[c] = in.scale * qr[c];
        Kr[c] = kr[c];
        ar[c] = std::exp(gr[c]);
        dc[c] *= ar[c];
        Er[c] = dc[c];
        Qtr[c] = dc[c] * Qr[c];
        Ktr[c] = dc[c] * Kr[c];
      }
    }
    // Pair loop, column by column: for fixed s, dec = W_rs is carried down r = s+1 .. n-1 and feeds both
    // A_rs and M_rs; when the column is done dec = exp(Gamma_last - Gamma_s) = P_s.
    std::fill(A.begin(), A.end(), 0.0);
    std::fill(M.begin(), M.end(), 0.0);
    for (int64_t s = 0; s < n; ++s) {
      const double* Ks = &K[size_t(s * Dk)];
      const double* Qs = &Q[size_t(s * Dk)];
      double m0 = 0.0;
#pragma omp simd reduction(+ : m0)
      for (int64_t c = 0; c < Dk; ++c) m0 += Qs[c] * Ks[c];
      M[size_t(s * C + s)] = m0;
      for (int64_t c = 0; c < Dk; ++c) dc[c] = 1.0;
      for (int64_t r = s + 1; r < n; ++r) {
        const double *Kr = &K[size_t(r * Dk)], *Qr = &Q[size_t(r * Dk)], *ar = &alpha[size_t(r * Dk)];
        double a = 0.0, m = 0.0;
#pragma omp simd reduction(+ : a, m)
        for (int64_t c = 0; c < Dk; ++c) {
          dc[c] *= ar[c];
          const double kw = Ks[c] * dc[c];  // k_s * W_rs
          a += Kr[c] * kw;
          m += Qr[c] * kw;
        }
        A[size_t(r * C + s)] = a;
        M[size_t(r * C + s)] = m;
      }
      double *Ps = &P[size_t(s * Dk)], *Kds = &Kd[size_t(s * Dk)];
      for (int64_t c = 0; c < Dk; ++c) {
        Ps[c] = dc[c];
        Kds[c] = Ks[c] * dc[c];
      }
    }
    // X = V - Kt S0, then the forward substitution X_r -= sum_{s<r} A_rs u_s; u_r = beta_r X_r.
    for (int64_t r = 0; r < n; ++r) std::copy_n(in.v + (t0 + r) * HDv + h * Dv, Dv, &X[size_t(r * Dv)]);
    gemm_nn(X.data(), Dv, Kt.data(), Dk, S0, Dv, n, Dv, Dk, -1.0);
    for (int64_t r = 0; r < n; ++r) {
      double* Xr = &X[size_t(r * Dv)];
      for (int64_t s = 0; s < r; ++s) {
        const double a = A[size_t(r * C + s)];
        const double* Us = &U[size_t(s * Dv)];
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) Xr[j] -= a * Us[j];
      }
      const double b = in.beta[(t0 + r) * in.H + h];
      double* Ur = &U[size_t(r * Dv)];
      for (int64_t j = 0; j < Dv; ++j) Ur[j] = b * Xr[j];
    }
  }
};

}  // namespace

void kda_chunk_forward_f64(double* o, double* chunk_states, const double* q, const double* k, const double* v,
                           const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                           int64_t Dv, int64_t chunk) {
  const Inputs in{q, k, v, g, beta, scale, T, H, Dk, Dv};
  check_args("kda_chunk_forward_f64", in, chunk);
  if (T == 0) return;
  const int64_t C = chunk, DD = Dk * Dv, HDv = H * Dv;
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    ChunkForward f(C, Dk, Dv);
    std::vector<double> S(size_t(DD), 0.0), O(size_t(C * Dv));
    for (int64_t t0 = 0, ci = 0; t0 < T; t0 += C, ++ci) {
      const int64_t n = std::min(C, T - t0);
      if (chunk_states) std::copy(S.begin(), S.end(), chunk_states + (ci * H + h) * DD);
      f.compute(in, h, t0, n, S.data());
      // O = Qt S0 + M U.
      std::fill(O.begin(), O.end(), 0.0);
      gemm_nn(O.data(), Dv, f.Qt.data(), Dk, S.data(), Dv, n, Dv, Dk, 1.0);
      gemm_nn(O.data(), Dv, f.M.data(), C, f.U.data(), Dv, n, Dv, n, 1.0);
      for (int64_t r = 0; r < n; ++r) std::copy_n(&O[size_t(r * Dv)], Dv, o + (t0 + r) * HDv + h * Dv);
      // S = Diag(E_last) S0 + Kd^T U.
      const double* El = &f.E[size_t((n - 1) * Dk)];
      for (int64_t c = 0; c < Dk; ++c)
        for (int64_t j = 0; j < Dv; ++j) S[size_t(c * Dv + j)] *= El[c];
      gemm_tn(S.data(), Dv, f.Kd.data(), Dk, f.U.data(), Dv, Dk, Dv, n, 1.0);
    }
  }
}

void kda_chunk_backward_f64(double* dq, double* dk, double* dv, double* dg, double* dbeta, const double* d_o,
                            const double* chunk_states, const double* q, const double* k, const double* v,
                            const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                            int64_t Dv, int64_t chunk) {
  const Inputs in{q, k, v, g, beta, scale, T, H, Dk, Dv};
  check_args("kda_chunk_backward_f64", in, chunk);
  if (T == 0) return;
  K3_CHECK(chunk_states != nullptr, "kda_chunk_backward_f64: chunk_states is null (the forward must save them)");
  const int64_t C = chunk, DD = Dk * Dv, HDk = H * Dk, HDv = H * Dv;
  const int64_t n_chunks = (T + C - 1) / C;
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    ChunkForward f(C, Dk, Dv);
    auto buf = [](int64_t n) { return std::vector<double>(size_t(n), 0.0); };
    std::vector<double> dS = buf(DD), dS0 = buf(DD);  // dL/dS_end of this chunk, dL/dS0
    std::vector<double> dO = buf(C * Dv), dU = buf(C * Dv), dX = buf(C * Dv);
    std::vector<double> dM = buf(C * C), dA = buf(C * C);
    std::vector<double> dQt = buf(C * Dk), dKt = buf(C * Dk), dKd = buf(C * Dk);
    std::vector<double> dQ = buf(C * Dk), dK = buf(C * Dk), dG = buf(C * Dk);  // dG = dL/dGamma
    std::vector<double> dc = buf(Dk);
    std::vector<double> dST = buf(DD), S0T = buf(DD), UT = buf(Dv * C);  // transposed right operands
    for (int64_t ci = n_chunks - 1; ci >= 0; --ci) {
      const int64_t t0 = ci * C, n = std::min(C, T - t0);
      const double* S0 = chunk_states + (ci * H + h) * DD;
      f.compute(in, h, t0, n, S0);
      const double* El = &f.E[size_t((n - 1) * Dk)];
      for (int64_t r = 0; r < n; ++r) std::copy_n(d_o + (t0 + r) * HDv + h * Dv, Dv, &dO[size_t(r * Dv)]);

      // S_end = Diag(E_last) S0 + Kd^T U, and O = Qt S0 + M U: everything that reads U or S0.
      std::fill(dG.begin(), dG.end(), 0.0);
      double* dGl = &dG[size_t((n - 1) * Dk)];
      for (int64_t c = 0; c < Dk; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j < Dv; ++j) {
          acc += S0[c * Dv + j] * dS[size_t(c * Dv + j)];
          dS0[size_t(c * Dv + j)] = El[c] * dS[size_t(c * Dv + j)];
        }
        dGl[c] += El[c] * acc;
      }
      transpose(dST.data(), dS.data(), Dk, Dv, Dv);
      transpose(S0T.data(), S0, Dk, Dv, Dv);
      transpose(UT.data(), f.U.data(), n, Dv, Dv);
      for (auto* z : {&dU, &dKd, &dM, &dQt, &dA, &dKt}) std::fill(z->begin(), z->end(), 0.0);
      gemm_nn(dU.data(), Dv, f.Kd.data(), Dk, dS.data(), Dv, n, Dv, Dk, 1.0);   // dU = Kd dS
      gemm_tn(dU.data(), Dv, f.M.data(), C, dO.data(), Dv, n, Dv, n, 1.0);      // dU += M^T dO
      gemm_nn(dKd.data(), Dk, f.U.data(), Dv, dST.data(), Dk, n, Dk, Dv, 1.0);  // dKd = U dS^T
      gemm_nn(dM.data(), C, dO.data(), Dv, UT.data(), n, n, n, Dv, 1.0);        // dM = dO U^T
      gemm_nn(dQt.data(), Dk, dO.data(), Dv, S0T.data(), Dk, n, Dk, Dv, 1.0);   // dQt = dO S0^T
      gemm_tn(dS0.data(), Dv, f.Qt.data(), Dk, dO.data(), Dv, Dk, Dv, n, 1.0);  // dS0 += Qt^T dO

      // Reverse of the forward substitution: dB_r = dU_r - sum_{r'>r} A_r'r dX_r' (in place in dU).
      for (int64_t r = n - 1; r >= 0; --r) {
        double* dBr = &dU[size_t(r * Dv)];
        for (int64_t rp = r + 1; rp < n; ++rp) {
          const double a = f.A[size_t(rp * C + r)];
          const double* dXrp = &dX[size_t(rp * Dv)];
#pragma omp simd
          for (int64_t j = 0; j < Dv; ++j) dBr[j] -= a * dXrp[j];
        }
        const double b = beta[(t0 + r) * H + h];
        const double* Xr = &f.X[size_t(r * Dv)];
        double* dXr = &dX[size_t(r * Dv)];
        double db = 0.0;
        for (int64_t j = 0; j < Dv; ++j) {
          db += dBr[j] * Xr[j];
          dXr[j] = b * dBr[j];
        }
        dbeta[(t0 + r) * H + h] = db;
        std::copy_n(dXr, Dv, dv + (t0 + r) * HDv + h * Dv);  // R = V - Kt S0: dV = dX
      }
      gemm_nn(dA.data(), C, dX.data(), Dv, UT.data(), n, n, n, Dv, -1.0);        // dA = -dX U^T
      gemm_nn(dKt.data(), Dk, dX.data(), Dv, S0T.data(), Dk, n, Dk, Dv, -1.0);   // dKt = -dX S0^T
      gemm_tn(dS0.data(), Dv, f.Kt.data(), Dk, dX.data(), Dv, Dk, Dv, n, -1.0);  // dS0 -= Kt^T dX

      // Elementwise terms: Qt = E Q, Kt = E k, Kd = P k, M's diagonal.
      for (int64_t r = 0; r < n; ++r) {
        const int64_t o = r * Dk;
        const double mrr = dM[size_t(r * C + r)];
        for (int64_t c = 0; c < Dk; ++c) {
          const double y = dKd[size_t(o + c)] * f.Kd[size_t(o + c)];
          dG[size_t(o + c)] += dQt[size_t(o + c)] * f.Qt[size_t(o + c)] + dKt[size_t(o + c)] * f.Kt[size_t(o + c)] - y;
          dGl[c] += y;
          dQ[size_t(o + c)] = dQt[size_t(o + c)] * f.E[size_t(o + c)] + mrr * f.K[size_t(o + c)];
          dK[size_t(o + c)] = dKt[size_t(o + c)] * f.E[size_t(o + c)] + dKd[size_t(o + c)] * f.P[size_t(o + c)] +
                              mrr * f.Q[size_t(o + c)];
        }
      }
      // Pair terms, column by column with the same running decay product as the forward.
      for (int64_t s = 0; s < n; ++s) {
        const double* Ks = &f.K[size_t(s * Dk)];
        double *dKs = &dK[size_t(s * Dk)], *dGs = &dG[size_t(s * Dk)];
        for (int64_t c = 0; c < Dk; ++c) dc[size_t(c)] = 1.0;
        double* w = dc.data();
        for (int64_t r = s + 1; r < n; ++r) {
          const double am = dM[size_t(r * C + s)], aa = dA[size_t(r * C + s)];
          const double *Kr = &f.K[size_t(r * Dk)], *Qr = &f.Q[size_t(r * Dk)], *ar = &f.alpha[size_t(r * Dk)];
          double *dQr = &dQ[size_t(r * Dk)], *dKr = &dK[size_t(r * Dk)], *dGr = &dG[size_t(r * Dk)];
#pragma omp simd
          for (int64_t c = 0; c < Dk; ++c) {
            w[c] *= ar[c];
            const double kw = Ks[c] * w[c];
            const double t = am * Qr[c] + aa * Kr[c];
            dQr[c] += am * kw;
            dKr[c] += aa * kw;
            dKs[c] += t * w[c];
            const double x = t * kw;
            dGr[c] += x;
            dGs[c] -= x;
          }
        }
      }
      // Write out: dq = scale dQ, dk, and dg = reverse cumulative sum of dGamma within the chunk.
      for (int64_t c = 0; c < Dk; ++c) dc[size_t(c)] = 0.0;
      for (int64_t r = n - 1; r >= 0; --r) {
        const int64_t o = r * Dk, row = (t0 + r) * HDk + h * Dk;
        for (int64_t c = 0; c < Dk; ++c) {
          dc[size_t(c)] += dG[size_t(o + c)];
          dg[row + c] = dc[size_t(c)];
          dq[row + c] = scale * dQ[size_t(o + c)];
          dk[row + c] = dK[size_t(o + c)];
        }
      }
      dS.swap(dS0);
    }
  }
}

}  // namespace k3::kda
