// Gated activations on the GPU: the CUDA twin of kernels/ffn/glu.h (k3::glu_forward), same
// GluParams (SiTU-GLU with activation_situ_beta / activation_situ_linear_beta, or SwiGLU):
//   SiTU-GLU(g, u) = [b1·tanh(g/b1)·sigmoid(g)] · [b2·tanh(u/b2)]      sigmoid of the UNCAPPED gate
// Evaluated in fp32 with the accurate tanhf/expf (no fast-math) and the overflow-free sigmoid of
// glu_cpu.cpp; one rounding at the store. With BF16 in/out the kernel is bound by instruction issue,
// not memory (about 100 instructions an element: two tanhf, an expf, three divisions), so
// glu_cuda.cu forms the same bits with fewer instructions: a power-of-two beta divides by
// multiplying with its exact reciprocal, the other divisions run the IEEE division's own fast path
// where its range check provably passes, and bf16 pairs are narrowed by the hardware conversion. gate/up are F32 or BF16 (same type), out F32 or BF16.
// Rows × cols with row strides, so the gate and up halves of one fused [rows, 2I] GEMM output
// can be passed directly (gate = base, up = base + I, ld_in = 2I). Device pointers; default stream.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "kernels/ffn/glu.h"

namespace k3::ffn::cuda {

struct GluLaunch {
  void* out = nullptr;  // [rows, ld_out] of out_type; may alias gate or up (same type and stride)
  DType out_type = DType::F32;
  int64_t ld_out = 0;          // elements (0: cols)
  const void* gate = nullptr;  // [rows, ld_in] of in_type
  const void* up = nullptr;    // [rows, ld_in] of in_type
  DType in_type = DType::F32;
  int64_t ld_in = 0;  // elements (0: cols)
  int64_t rows = 0, cols = 0;
  GluParams act;  // situ on/off, beta_gate, beta_up
};

std::string can_run(const GluLaunch& p);
void glu_forward(const GluLaunch& p);

// Contiguous shorthand: out[i] = act(gate[i], up[i]) for n elements (fp32).
void glu_forward(float* out, const float* gate, const float* up, int64_t n, const GluParams& act);

}  // namespace k3::ffn::cuda
