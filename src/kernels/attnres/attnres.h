// Block Attention Residuals (K3-ARCHITECTURE.md §5.2; AttnRes paper eq. 2-6), per token:
//   K_i = V_i / sqrt(mean(V_i^2) + eps)          (RMS-normalised key, no weight)
//   s_i = dot(K_i, query)                         (query = res_norm.weight ⊙ res_proj.weight, folded)
//   out = Σ_i softmax(s)_i V_i                    (the weights multiply the RAW sources)
// Computed in fp64 with a max-subtracted softmax and rounded once to fp32 (the reference does it in
// fp32; fp64 only removes our own rounding). S sources of [N, D] rows, the partial block sum last.
#pragma once
#include <cstdint>
#include <vector>

namespace k3 {

void attnres_forward(float* out, const float* const* sources, int S, int64_t N, int64_t D, const float* query,
                     float eps);

// Float64, for training: the same mixing over sources src[i] [N, D] (the reference's formula; no
// rounding), and its backward: dsrc[i] and dq ACCUMULATED (a source is read by several uses).
void attnres_forward(double* out, const std::vector<const double*>& src, const double* q, double eps, int64_t N,
                     int64_t D);
void attnres_backward(const std::vector<double*>& dsrc, double* dq, const double* dout,
                      const std::vector<const double*>& src, const double* q, double eps, int64_t N, int64_t D);

}  // namespace k3
