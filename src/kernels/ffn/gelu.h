// GELU, the math of each value in double:
//   tanh form  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (PyTorch's approximate="tanh"; MoonViT's MLP)
//   erf form   0.5 x (1 + erf(x / sqrt(2)))                     (nn.GELU(); K3's vision projector)
// fp32 in place for inference; float64 forward and backward for training (the vision tower's, in
// model/training/vision_train.h). Both precisions evaluate one scalar definition per form.
#pragma once
#include <cstdint>

namespace k3 {

// In place over n fp32 values.
void gelu_tanh_forward(float* x, int64_t n);
void gelu_erf_forward(float* x, int64_t n);

// Float64: y = gelu(x) over n values (y may alias x), and the backward dx = dy ⊙ gelu'(x) (dx OVERWRITTEN,
// may alias dy), with
//   tanh form  gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t²) sqrt(2/pi) (1 + 3 · 0.044715 x²),  t = tanh(...) as above
//   erf form   gelu'(x) = 0.5 (1 + erf(x / sqrt(2))) + x exp(-x² / 2) / sqrt(2 pi)
void gelu_tanh_forward(double* y, const double* x, int64_t n);
void gelu_tanh_backward(double* dx, const double* dy, const double* x, int64_t n);
void gelu_erf_forward(double* y, const double* x, int64_t n);
void gelu_erf_backward(double* dx, const double* dy, const double* x, int64_t n);

}  // namespace k3
