// MXFP4 (OCP microscaling, E2M1 elements + E8M0 scale per 32) as stored by compressed-tensors
// `mxfp4-pack-quantized` in the Kimi K3 release (K3-ARCHITECTURE.md §7):
//   weight_packed [out, in/2] U8: byte j holds element 2j in the LOW nibble, 2j+1 in the high one.
//   weight_scale  [out, in/32] U8: value = E2M1[nibble] * 2^(scale - 127); 255 is NaN.
// Decoding is exact in fp32 (every product is a power-of-two multiple of a 3-bit mantissa).
#pragma once
#include <cmath>
#include <cstdint>

namespace k3 {

inline constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float e8m0_to_f32(uint8_t s) {
  if (s == 255) return NAN;
  return std::ldexp(1.0f, int(s) - 127);
}

// Decode one row of `cols` elements (cols % 32 == 0).
inline void mxfp4_decode_row(float* dst, const uint8_t* packed, const uint8_t* scales, int64_t cols) {
  for (int64_t g = 0; g < cols / 32; ++g) {
    const float s = e8m0_to_f32(scales[g]);
    const uint8_t* p = packed + g * 16;
    float* d = dst + g * 32;
    for (int j = 0; j < 16; ++j) {
      d[2 * j] = kE2M1[p[j] & 0xf] * s;
      d[2 * j + 1] = kE2M1[p[j] >> 4] * s;
    }
  }
}

}  // namespace k3
