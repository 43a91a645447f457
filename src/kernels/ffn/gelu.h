// GELU, in place over n fp32 values, the math of each value in double:
//   tanh form  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (PyTorch's approximate="tanh"; MoonViT's MLP)
//   erf form   0.5 x (1 + erf(x / sqrt(2)))                     (nn.GELU(); K3's vision projector)
#pragma once
#include <cstdint>

namespace k3 {

void gelu_tanh_forward(float* x, int64_t n);
void gelu_erf_forward(float* x, int64_t n);

}  // namespace k3
