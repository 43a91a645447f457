// The vision tower's own ops on the CPU (MoonViT-V2, K3-ARCHITECTURE.md §8): the learned position table resized
// to a patch grid, the sin-cos time embedding of a clip's frames, the 2D rotary embedding, and bidirectional
// attention over one item's patches. fp32 in and out, the arithmetic in double.
#pragma once
#include <cstdint>

namespace k3 {

// table [H0, W0, D] resized to out [h, w, D] as PyTorch's F.interpolate(mode="bilinear") does by default
// (align_corners = false, no antialiasing): output row i reads source row (i + 0.5) H0 / h - 0.5, clamped below
// at 0, between its floor and the next row (the last row repeats); columns likewise. A copy when the sizes agree.
void position_table_resize(float* out, const float* table, int64_t H0, int64_t W0, int64_t h, int64_t w, int64_t D);

// out [t, D]: frame f's embedding [sin(f w_i) | cos(f w_i)] with w_i = 10000^(-i / (D/2)), i < D/2 (D even).
void frame_time_embedding(float* out, int64_t t, int64_t D);

// In place on n rows of x (row stride ld), each holding `heads` head vectors of hd values (hd % 4 == 0), each
// vector seen as hd/2 pairs (x[2j], x[2j+1]) = re + i im: pair 2i turns by cols[r] f_i and pair 2i + 1 by
// rows[r] f_i, f_i = 10000^(-4i / hd), i < hd/4. The column comes first (the reference's x is the column).
void rope2d_forward(float* x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows,
                    const int32_t* cols);

// o [n, heads * hd] (dense) = softmax(q kᵀ / sqrt(hd)) v per head over the n rows of one item, every row
// seeing every row. q, k, v: n rows of stride ld, heads * hd values each, head-major. Scores, softmax and the
// weighted sum in double.
void attention_bidirectional(float* o, const float* q, const float* k, const float* v, int64_t ld, int64_t n,
                             int64_t heads, int64_t hd);

}  // namespace k3
