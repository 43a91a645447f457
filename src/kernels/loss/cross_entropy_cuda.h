// Vocabulary-chunked softmax cross-entropy on the GPU, fp32: the pieces of the CUDA twin of
// k3::cross_entropy (kernels/loss/cross_entropy.h) that never hold [N × V] logits. The caller loops
// over vocabulary chunks [v0, v0+Vc), each time writing the chunk's logits into an [N, ld] fp32
// buffer (column j holds vocabulary entry v0 + j) with a GEMM:
//   ce_init                                 row_max = −inf, row_sum = 0, target_logit = 0
//   for each chunk: GEMM; ce_chunk_update   online log-sum-exp: m' = max(m, max_j l_j),
//                                           z' = z·e^(m−m') + Σ_j e^(l_j−m'); picks l[target]
//   ce_finish                               lse = m + log z; loss_sum = Σ_{target>=0} (lse − l[target])
//   for each chunk: GEMM; ce_chunk_grad     dlogits = scale·(softmax − onehot) in place, 0 for target < 0
// (the second sweep recomputes the logits). target −1 means "no prediction at this row"; a target
// must be < V (not checked here: the kernels never see V).
//
// Numerics: the chunk's max and sum are accumulated in fp32 per thread (online: one exp per element)
// and merged over the block in a fixed order; lse is rounded once to fp32 from a double m + log z,
// so the gradient's softmax exp(l − lse) carries a relative error of at most ~2^-24·|lse| (5e-6 at
// |lse| = 80) beyond expf's. The loss is summed in double, row by row as (m − l[target]) + log z,
// in a fixed order (per-block partials, then the partials in block order): bitwise reproducible.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstddef>
#include <cstdint>

namespace k3::loss::cuda {

// row_max [N] = −inf, row_sum [N] = 0, target_logit [N] = 0.
void ce_init(float* row_max, float* row_sum, float* target_logit, int64_t N);

// Online log-sum-exp update with the logits of columns [v0, v0+Vc) held in logits [N, ld] (ld >= Vc);
// also sets target_logit[n] when target[n] falls in the chunk. target [N] (device, −1: none).
void ce_chunk_update(float* row_max, float* row_sum, float* target_logit, const float* logits, int64_t ld,
                     const int32_t* target, int64_t N, int64_t v0, int64_t Vc);

// Scratch for ce_finish: one double per block of rows.
size_t ce_finish_workspace_bytes(int64_t N);

// lse [N] = row_max + log(row_sum) (every row); *loss_sum (one device double, OVERWRITTEN) =
// Σ over rows with target >= 0 of w_n (lse − target_logit), summed in a fixed order; w_n = row_weight[n] (device
// [N], optional: a policy-gradient step's per-token coefficients), else 1.
void ce_finish(float* lse, double* loss_sum, const float* row_max, const float* row_sum, const float* target_logit,
               const int32_t* target, int64_t N, void* workspace, const float* row_weight = nullptr);

// In place: logits [N, ld] (columns [v0, v0+Vc)) become scale·w_n·(exp(l − lse) − [v == target]) for
// rows with target >= 0 (w_n as in ce_finish), and 0 for the other rows. Columns >= Vc are untouched.
void ce_chunk_grad(float* logits, int64_t ld, const float* lse, const int32_t* target, float scale, int64_t N,
                   int64_t v0, int64_t Vc, const float* row_weight = nullptr);

}  // namespace k3::loss::cuda
