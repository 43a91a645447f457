// The vision tower's own ops in float64 for training (MoonViT-V2, K3-ARCHITECTURE.md §8), each forward beside its
// backward: the position table's bilinear resize and its transpose, the clip's time embedding (fixed, no
// gradient), the 2D rotary embedding, bidirectional attention over one item, and the sd2_tpool merge. The
// forwards are the functions of vision.h (which defines them exactly) computed without rounding to float32; the
// tower's float64 forward and backward that use them are model/training/vision_train.h.
//
// Gradient rule (llm.c's): gradients of the op's inputs are OVERWRITTEN, except the position table's, which is a
// parameter and ACCUMULATES. Layouts and strides as in vision.h.
#pragma once
#include <cstdint>

namespace k3 {

// out [h, w, D] = position_table_resize(table [H0, W0, D]) in float64 (OVERWRITTEN).
void position_table_resize_f64(double* out, const double* table, int64_t H0, int64_t W0, int64_t h, int64_t w,
                               int64_t D);
// The transpose of that linear map: dtable [H0, W0, D] += Rᵀ dout, dout [h, w, D]. Each output position gives its
// gradient back to the (up to) four table rows it read, with the same bilinear weights; a table row may take
// from many positions (the grid larger than the table) or from none (smaller). The identity when the sizes agree.
void position_table_resize_backward_f64(double* dtable, const double* dout, int64_t H0, int64_t W0, int64_t h,
                                        int64_t w, int64_t D);

// out [t, D] = frame_time_embedding in float64 (the fp32 form rounds this).
void frame_time_embedding_f64(double* out, int64_t t, int64_t D);

// In place, as rope2d_forward: each pair turned by its angle (the column's for pair 2i, the row's for 2i + 1).
void rope2d_forward_f64(double* x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows,
                        const int32_t* cols);
// Its backward, in place on dx (same layout): a rotation's transpose is the rotation by the opposite angle.
void rope2d_backward_f64(double* dx, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows,
                         const int32_t* cols);

// o [n, heads * hd] (dense, OVERWRITTEN) = attention_bidirectional(q, k, v) in float64. lse [heads, n]: log Σ_j
// exp(s_ij) per head and query row (s = q kᵀ / sqrt(hd)), saved so the backward recomputes the probabilities
// P_ij = exp(s_ij - lse_i) instead of keeping [heads, n, n].
void attention_bidirectional_forward_f64(double* o, double* lse, const double* q, const double* k, const double* v,
                                         int64_t ld, int64_t n, int64_t heads, int64_t hd);
// Its backward from dO [n, heads * hd] (dense), the inputs and the saved o and lse. Per head:
//   dv_j = Σ_i P_ij do_i;  dP_ij = do_i · v_j;  dS_ij = P_ij (dP_ij - do_i · o_i)
//   dq_i = Σ_j dS_ij k_j / sqrt(hd);  dk_j = Σ_i dS_ij q_i / sqrt(hd)
// (Σ_j P_ij dP_ij = do_i · o_i). dq, dk, dv: n rows of stride ldd, heads * hd values each, OVERWRITTEN; other
// columns of their rows are left alone (they may be the q, k and v column blocks of one [n, 3 heads hd] buffer).
void attention_bidirectional_backward_f64(double* dq, double* dk, double* dv, int64_t ldd, const double* dO,
                                          const double* q, const double* k, const double* v, int64_t ld,
                                          const double* o, const double* lse, int64_t n, int64_t heads, int64_t hd);

// sd2_tpool over one item's patches x [t, h, w, D] (rows in (t, h, w) order): merged [(h/mh)(w/mw), mh mw, D]
// (OVERWRITTEN), merged token (a, b) holding patches (a mh + i, b mw + j), i < mh, j < mw, row-major, each averaged
// over the t frames. h % mh == 0 and w % mw == 0.
void patch_merge_forward_f64(double* merged, const double* x, int64_t t, int64_t h, int64_t w, int64_t mh, int64_t mw,
                             int64_t D);
// Its backward: dx [t, h, w, D] OVERWRITTEN; every frame's copy of a patch gets its merged slot's gradient / t.
void patch_merge_backward_f64(double* dx, const double* dmerged, int64_t t, int64_t h, int64_t w, int64_t mh,
                              int64_t mw, int64_t D);

}  // namespace k3
