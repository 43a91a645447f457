// Float64 forward/backward of the small ops the training model is built from: linear layers,
// RMSNorm, Block AttnRes mixing, softmax cross-entropy. Backward functions ACCUMULATE parameter
// gradients and OVERWRITE input gradients unless their comment says otherwise.
#pragma once
#include <cstdint>
#include <vector>

namespace k3::train {

// y[N, out] = x[N, in] · W[out, in]^T
void linear_fwd(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out);
// dx[N, in] = dy · W (overwritten; skipped when dx is null); dW[out, in] += dy^T · x
void linear_bwd(double* dx, double* dW, const double* dy, const double* x, const double* W, int64_t N, int64_t in,
                int64_t out);

// y = w ⊙ x / sqrt(mean(x²) + eps), row by row ([N, D]); w may be null (no weight).
void rmsnorm_fwd(double* y, const double* x, const double* w, double eps, int64_t N, int64_t D);
// dx overwritten; dw accumulated (when both w and dw are given).
void rmsnorm_bwd(double* dx, double* dw, const double* dy, const double* x, const double* w, double eps, int64_t N,
                 int64_t D);

// Block AttnRes (K3-ARCHITECTURE.md §5.2), per row n: score_i = (v_i · q) / sqrt(mean(v_i²) + eps),
// α = softmax(score), out = Σ_i α_i v_i, over S sources v_i [N, D] and a query q [D].
void attnres_fwd(double* out, const std::vector<const double*>& src, const double* q, double eps, int64_t N, int64_t D);
// dsrc[i] ACCUMULATED (they are sums of several uses); dq accumulated.
void attnres_bwd(const std::vector<double*>& dsrc, double* dq, const double* dout, const std::vector<const double*>& src,
                 const double* q, double eps, int64_t N, int64_t D);

// Sum over rows of -log softmax(logits[r])[target[r]] (rows with target < 0 are skipped); when
// dlogits is given it receives (softmax - onehot) * scale for every row (0 for skipped rows).
double cross_entropy(const double* logits, const int32_t* target, int64_t N, int64_t V, double* dlogits, double scale);

}  // namespace k3::train
