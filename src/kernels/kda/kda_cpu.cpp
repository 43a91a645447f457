// KDA CPU reference kernels. See kda.h for the contracts; this file explains the numerics.
//
// Precision: inputs and outputs are fp32, but the recurrent state and every intermediate of the
// recurrence and of the chunked form are fp64. Why: decoding runs the recurrence token by token while
// a prefill runs the chunked form, and the model must give the same logits either way. In fp32 the two
// forms differ by ~2e-7 per layer, and the golden K3 fixture amplifies such differences ~100x at some
// tokens, enough to part cached decoding from full recomputation (docs/NUMERICS.md, "KDA"). In fp64 the
// two forms agree to ~1e-15 before the single rounding of o to fp32. It is cheap on a CPU: KDA is
// ~H*Dk*Dv*4 flops per token, under 1% of a K3 layer's projections.
#include "kernels/kda/kda.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm/tiled_f64.h"

namespace k3::kda {
namespace {

// 1 / (1 + e^-x). For x -> -inf, e^-x -> inf and the quotient is 0; for x -> +inf it is 1. No NaN.
inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

constexpr int64_t kMR = kTiledF64Rows;  // the forward substitution's row block: one tile of rows

// C += alpha · A · B (row-major): the chunked form's products, k3::gemm_acc_f64 (kernels/gemm/tiled_f64.h).
inline void matmul_acc(double* C, int64_t ldc, const double* A, int64_t lda, const double* B, int64_t ldb, int64_t m,
                       int64_t nn, int64_t kk, double alpha) {
  gemm_acc_f64<false>(C, ldc, A, lda, B, ldb, m, nn, kk, alpha);
}

void check_dims(const char* fn, int64_t T, int64_t H, int64_t D, const char* dname) {
  K3_CHECK(T >= 0, fn, ": T must be >= 0, got ", T);
  K3_CHECK(H >= 1, fn, ": H must be >= 1, got ", H);
  K3_CHECK(D >= 1, fn, ": ", dname, " must be >= 1, got ", D);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Short convolution + SiLU.
void short_conv_silu_forward(float* out, const float* x, int64_t T, int64_t C, const float* weight, int K,
                             float* tail) {
  K3_CHECK(T >= 0, "short_conv_silu_forward: T must be >= 0, got ", T);
  K3_CHECK(C >= 1, "short_conv_silu_forward: C must be >= 1, got ", C);
  K3_CHECK(K >= 1, "short_conv_silu_forward: K must be >= 1, got ", K);
  const int64_t P = K - 1;  // history length

  // Input at sequence position s relative to this call: s >= 0 is x[s], s in [-P, -1] is tail[P + s].
  // All outputs are computed from the OLD tail first; the tail is updated afterwards.
  parallel_for(T, T * C * K, [&](int64_t t) {
    float* o = out + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
    // Taps in order j = 0..K-1 (oldest input first), same order whichever buffer the input comes from,
    // so a sequence split across calls gives bit-identical outputs.
    for (int j = 0; j < K; ++j) {
      const int64_t s = t - P + j;
      const float* in;
      if (s >= 0) {
        in = x + s * C;
      } else if (tail != nullptr) {
        in = tail + (P + s) * C;
      } else {
        continue;  // zero history contributes nothing
      }
      for (int64_t c = 0; c < C; ++c) o[c] += weight[c * K + j] * in[c];
    }
    for (int64_t c = 0; c < C; ++c) o[c] = o[c] * sigmoidf(o[c]);  // SiLU(y) = y * sigmoid(y)
  });

  if (tail != nullptr && P > 0) {
    // New tail row m = position T - P + m of the concatenation [old tail ; x]. Rows are filled in increasing
    // m, and a row taken from the old tail has index T + m > m, which has not been overwritten yet.
    for (int64_t m = 0; m < P; ++m) {
      const int64_t s = T - P + m;
      const float* src = s >= 0 ? x + s * C : tail + (P + s) * C;
      if (src != tail + m * C) std::memcpy(tail + m * C, src, sizeof(float) * C);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Per-head L2 norm. The sum of squares is accumulated in double: it costs nothing next to the projections
// and makes this kernel the more accurate side of any parity test against a GPU implementation.
void l2norm_heads(float* x, int64_t T, int64_t H, int64_t D, float eps) {
  check_dims("l2norm_heads", T, H, D, "D");
  K3_CHECK(eps >= 0.0f, "l2norm_heads: eps must be >= 0, got ", eps);
  const int64_t rows = T * H;
  parallel_for(rows, rows * D, [&](int64_t r) {
    float* p = x + r * D;
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += double(p[d]) * p[d];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss + eps));
    for (int64_t d = 0; d < D; ++d) p[d] *= inv;
  });
}

// ---------------------------------------------------------------------------------------------------------
// Decay gate. sigmoid saturates to exactly 1.0f for large arguments, so g can equal lower_bound exactly in
// fp32 (alpha = e^lower_bound, still >= the bound); the kernels below are tested at exactly that value.
void gate_forward(float* g, const float* z, const float* A_log, const float* dt_bias, float lower_bound, int64_t T,
                  int64_t H, int64_t D) {
  check_dims("gate_forward", T, H, D, "D");
  K3_CHECK(std::isfinite(lower_bound) && lower_bound < 0.0f,
           "gate_forward: lower_bound must be finite and negative, got ", lower_bound);
  parallel_for(T, T * H * D, [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      const int64_t base = (t * H + h) * D;
      for (int64_t d = 0; d < D; ++d) g[base + d] = lower_bound * sigmoidf(a * (z[base + d] + dt_bias[h * D + d]));
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// The recurrence, literally as specified. Two passes over the Dk x Dv state per token:
//   pass 1 (row c): S[c,:] *= alpha[c];  u += k[c] * S[c,:]
//   pass 2 (row c): S[c,:] += (beta k[c]) * (v - u);  o += (scale q[c]) * S[c,:]
// Rows are contiguous, so every inner loop runs over contiguous Dv floats.
void kda_recurrent_forward(float* o, const float* q, const float* k, const float* v, const float* g, const float* beta,
                           float scale, double* state, int64_t T, int64_t H, int64_t Dk, int64_t Dv) {
  check_dims("kda_recurrent_forward", T, H, Dk, "Dk");
  K3_CHECK(Dv >= 1, "kda_recurrent_forward: Dv must be >= 1, got ", Dv);
  parallel_for(H, T * H * Dk * Dv, [&](int64_t h) {
    double* S = state + h * Dk * Dv;
    std::vector<double> u(Dv), dv(Dv), ov(Dv);
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + (t * H + h) * Dk;
      const float* kt = k + (t * H + h) * Dk;
      const float* gt = g + (t * H + h) * Dk;
      const float* vt = v + (t * H + h) * Dv;
      const double bt = beta[t * H + h];
      float* ot = o + (t * H + h) * Dv;

      for (int64_t j = 0; j < Dv; ++j) u[j] = 0.0;
      for (int64_t c = 0; c < Dk; ++c) {
        const double a = std::exp(double(gt[c]));
        const double kc = kt[c];
        double* row = S + c * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] *= a;
          u[j] += kc * row[j];
        }
      }
      for (int64_t j = 0; j < Dv; ++j) dv[j] = vt[j] - u[j];
      for (int64_t j = 0; j < Dv; ++j) ov[j] = 0.0;
      for (int64_t c = 0; c < Dk; ++c) {
        const double bk = bt * kt[c];
        const double sq = double(scale) * qt[c];
        double* row = S + c * Dv;
#pragma omp simd
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] += bk * dv[j];
          ov[j] += sq * row[j];
        }
      }
      for (int64_t j = 0; j < Dv; ++j) ot[j] = float(ov[j]);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// Chunked (WY/UT) form.
//
// Derivation. Let S_i be the state after local token i of a chunk, S0 the state entering it, and
// delta_i = beta_i (v_i - (Diag(alpha_i) S_{i-1})^T k_i). Then S_i = Diag(alpha_i) S_{i-1} + k_i delta_i^T,
// which unrolls to  S_i = Diag(e^{Gamma_i}) S0 + sum_{j<=i} Diag(e^{Gamma_i - Gamma_j}) k_j delta_j^T.
// Substituting S_{i-1} into delta_i gives the unit lower-triangular system in kda.h, and S_t^T q_t gives o_t.
//
// NUMERICS (why only differences are exponentiated). Inside a chunk Gamma_i is a running sum of g, and
// g >= -5, so Gamma reaches -5 * 64 = -320 in a 64-token chunk. The textbook factorisation
// exp(Gamma_i - Gamma_j) = exp(Gamma_i) * exp(-Gamma_j) would need exp(+320) ~ 1e139, far beyond the fp32
// maximum (~3.4e38 = e^88.7): inf, then inf * 0 = NaN. (At g >= -5 that is safe only up to chunk 17.) Every
// decay factor formed here is instead exp(Gamma_i - Gamma_j) with j <= i, or exp(Gamma_i) itself (j = "before
// the chunk"). The exponent is <= 0 because g <= 0, so every factor lies in [0, 1]: no overflow for any chunk
// size and any g <= 0. A factor that underflows is exactly a term that decayed away.
//
// How the factors are computed. exp(Gamma_i - Gamma_j) = prod_{j < tau <= i} exp(g_tau), so for each j the
// factors for i = j+1, j+2, ... are a running product of the per-token decays alpha_tau = exp(g_tau) <= 1.
// After <= 63 multiplies its relative error is ~1e-14 (exp of a difference of two running sums near -300
// would carry ~300 * 1e-16 absolute error, and in fp32 2e-5). With g >= -5 the products stay above
// e^-320 ~ 1e-139, far inside the normal double range, so no denormals reach the matmuls. It costs one exp per token and channel
// instead of one per pair and channel, where the exps would dominate the chunk's time (docs/NUMERICS.md, "KDA").
//
// Per head and chunk of n tokens, the work (multiply-adds) is:
//   pair loop   A (strictly lower) and M (lower incl. diagonal), sharing the factor e^{Gamma_i - Gamma_j}: n^2 Dk
//   S0 terms    W = Ktilde S0 and O = Qtilde S0, two matmuls: 2 n Dk Dv
//   solve       delta_i = beta_i (v_i - W_i - sum_{j<i} A_ij delta_j), blocked: n^2/2 Dv
//   output      o = scale (O + M delta): n^2 Dv
//   state       S = Diag(e^{Gamma_last}) S + Krestore^T delta: n Dk Dv
// i.e. about (3 Dk Dv + 2 n Dv + n Dk) per token against the recurrence's 4 Dk Dv, but in matmul form.
void kda_chunk_forward(float* o, const float* q, const float* k, const float* v, const float* g, const float* beta,
                       float scale, double* state, int64_t T, int64_t H, int64_t Dk, int64_t Dv, int chunk_size) {
  check_dims("kda_chunk_forward", T, H, Dk, "Dk");
  K3_CHECK(Dv >= 1, "kda_chunk_forward: Dv must be >= 1, got ", Dv);
  K3_CHECK(chunk_size >= 1, "kda_chunk_forward: chunk_size must be >= 1, got ", chunk_size);
  const int64_t Cs = chunk_size;

  parallel_for(H, T * H * Dk * Dv, [&](int64_t h) {
    double* S = state + h * Dk * Dv;
    // Per-head scratch, reused by every chunk of this head.
    std::vector<double> alpha(Cs * Dk);  // alpha_i[c] = exp(g_i[c]), in double for the running products
    std::vector<double> dec(Dk);         // a running decay product (see the pair loop)
    std::vector<double> Kt(Cs * Dk);     // Ktilde_i = exp(Gamma_i) * k_i
    std::vector<double> Qt(Cs * Dk);     // Qtilde_i = exp(Gamma_i) * q_i
    std::vector<double> KrT(Dk * Cs);    // KrT[c][j] = exp(Gamma_last[c] - Gamma_j[c]) * k_j[c]
    std::vector<double> A(Cs * Cs);      // A[i][j], j < i
    std::vector<double> M(Cs * Cs);      // M[i][j] = q_i . (k_j * exp(Gamma_i - Gamma_j)), j <= i; 0 above
    std::vector<double> W(Cs * Dv);      // Ktilde S0, then overwritten by delta
    std::vector<double> O(Cs * Dv);      // Qtilde S0, then the unscaled output
    std::vector<double> Pl(Dk);          // exp(Gamma_last)

    for (int64_t t0 = 0; t0 < T; t0 += Cs) {
      const int64_t n = std::min<int64_t>(Cs, T - t0);
      auto Q = [&](int64_t i) { return q + ((t0 + i) * H + h) * Dk; };
      auto Kp = [&](int64_t i) { return k + ((t0 + i) * H + h) * Dk; };
      auto V = [&](int64_t i) { return v + ((t0 + i) * H + h) * Dv; };

      // alpha; Ktilde and Qtilde from the running product exp(Gamma_i) = alpha_0 ... alpha_i.
      for (int64_t c = 0; c < Dk; ++c) dec[c] = 1.0;
      for (int64_t i = 0; i < n; ++i) {
        const float* gi = g + ((t0 + i) * H + h) * Dk;
        const float* ki = Kp(i);
        const float* qi = Q(i);
        for (int64_t c = 0; c < Dk; ++c) {
          alpha[i * Dk + c] = std::exp(double(gi[c]));
          dec[c] *= alpha[i * Dk + c];
          const double e = dec[c];
          Kt[i * Dk + c] = e * ki[c];
          Qt[i * Dk + c] = e * qi[c];
        }
      }
      for (int64_t c = 0; c < Dk; ++c) Pl[c] = dec[c];

      // Pair loop, column by column: for fixed j, dec = exp(Gamma_i - Gamma_j) is carried down i = j+1..n-1
      // and feeds both A_ij and M_ij. When the column is done, dec = exp(Gamma_last - Gamma_j) gives Krestore.
      // The inner loop runs in double (one vector loop, no flush needed): with K3's g >= -5 the products stay
      // above e^-320 ~ 1e-139, far inside the normal double range (only an average g < -11 over a whole
      // chunk would reach double denormals, which would cost time, not accuracy).
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = Kp(j);
        const float* qj = Q(j);
        double m0 = 0.0;
#pragma omp simd reduction(+ : m0)
        for (int64_t c = 0; c < Dk; ++c) m0 += double(qj[c]) * kj[c];
        M[j * Cs + j] = m0;  // exp(Gamma_j - Gamma_j) = 1
        double* dc = dec.data();
        for (int64_t c = 0; c < Dk; ++c) dc[c] = 1.0;
        for (int64_t i = j + 1; i < n; ++i) {
          const float* ki = Kp(i);
          const float* qi = Q(i);
          const double* ai = &alpha[i * Dk];
          double a = 0.0, m = 0.0;
#pragma omp simd reduction(+ : a, m)
          for (int64_t c = 0; c < Dk; ++c) {
            dc[c] *= ai[c];
            const double kd = kj[c] * dc[c];  // k_j * exp(Gamma_i - Gamma_j)
            a += ki[c] * kd;
            m += qi[c] * kd;
          }
          A[i * Cs + j] = a;
          M[i * Cs + j] = m;
        }
        for (int64_t c = 0; c < Dk; ++c) KrT[c * Cs + j] = kj[c] * dc[c];
      }

      // S0 terms: W = Ktilde S0, O = Qtilde S0.
      std::fill(W.begin(), W.begin() + n * Dv, 0.0);
      std::fill(O.begin(), O.begin() + n * Dv, 0.0);
      matmul_acc(W.data(), Dv, Kt.data(), Dk, S, Dv, n, Dv, Dk, 1.0);
      matmul_acc(O.data(), Dv, Qt.data(), Dk, S, Dv, n, Dv, Dk, 1.0);

      // Forward substitution, in place in W: delta_i = beta_i (v_i - W_i - sum_{j<i} A_ij delta_j), by blocks
      // of kMR rows: the finished deltas of earlier blocks enter as one matmul, the block itself row by row.
      for (int64_t i0 = 0; i0 < n; i0 += kMR) {
        const int64_t ib = std::min(kMR, n - i0);
        for (int64_t i = i0; i < i0 + ib; ++i) {
          const float* vi = V(i);
          double* Di = &W[i * Dv];
          for (int64_t j = 0; j < Dv; ++j) Di[j] = vi[j] - Di[j];
        }
        matmul_acc(&W[i0 * Dv], Dv, &A[i0 * Cs], Cs, W.data(), Dv, ib, Dv, i0, -1.0);
        for (int64_t i = i0; i < i0 + ib; ++i) {
          double* Di = &W[i * Dv];
          for (int64_t jj = i0; jj < i; ++jj) {
            const double a = A[i * Cs + jj];
            const double* Dj = &W[jj * Dv];
#pragma omp simd
            for (int64_t j = 0; j < Dv; ++j) Di[j] -= a * Dj[j];
          }
          const double b = beta[(t0 + i) * H + h];
          for (int64_t j = 0; j < Dv; ++j) Di[j] *= b;
        }
      }
      const double* delta = W.data();

      // Output: o_i = scale * (O_i + sum_{j<=i} M_ij delta_j). M is zero above the diagonal, so the causal sum
      // is a plain n x n matmul (the wasted upper half is ~8% of the chunk's flops and keeps the code simple).
      matmul_acc(O.data(), Dv, M.data(), Cs, delta, Dv, n, Dv, n, 1.0);
      for (int64_t i = 0; i < n; ++i) {
        float* oi = o + ((t0 + i) * H + h) * Dv;
        for (int64_t j = 0; j < Dv; ++j) oi[j] = float(double(scale) * O[i * Dv + j]);
      }

      // State: S[c,:] = exp(Gamma_last[c]) S[c,:] + sum_j KrT[c][j] delta_j.
      for (int64_t c = 0; c < Dk; ++c) {
        double* row = S + c * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] *= Pl[c];
      }
      matmul_acc(S, Dv, KrT.data(), Cs, delta, Dv, Dk, Dv, n, 1.0);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// Gated RMSNorm. Mean of squares in double for the same reason as l2norm_heads.
void gated_rmsnorm_forward(float* y, const float* o, const float* gate, const float* weight, float eps, int64_t T,
                           int64_t H, int64_t Dv) {
  check_dims("gated_rmsnorm_forward", T, H, Dv, "Dv");
  K3_CHECK(eps >= 0.0f, "gated_rmsnorm_forward: eps must be >= 0, got ", eps);
  const int64_t rows = T * H;
  parallel_for(rows, rows * Dv, [&](int64_t r) {
    const float* x = o + r * Dv;
    const float* gr = gate + r * Dv;
    float* yr = y + r * Dv;
    double ss = 0.0;
    for (int64_t d = 0; d < Dv; ++d) ss += double(x[d]) * x[d];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / double(Dv) + eps));
    for (int64_t d = 0; d < Dv; ++d) yr[d] = x[d] * inv * weight[d] * sigmoidf(gr[d]);
  });
}

}  // namespace k3::kda
