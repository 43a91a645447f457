#include "core/dtype.h"

#include "core/error.h"

namespace k3 {

bool dtype_from_name(const std::string& s, DType* out) {
  if (s == "F32") *out = DType::F32;
  else if (s == "BF16") *out = DType::BF16;
  else if (s == "F16") *out = DType::F16;
  else if (s == "U8") *out = DType::U8;
  else if (s == "I64") *out = DType::I64;
  else return false;
  return true;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void widen_to_f32(float* dst, const void* src, DType t, size_t n) {
  if (n == 0) return;  // an empty tensor's pointers may be null (memcpy with null is UB even for 0 bytes)
  switch (t) {
    case DType::F32: std::memcpy(dst, src, n * 4); return;
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    default: fail("internal error: widen_to_f32 called on ", dtype_name(t));
  }
}

}  // namespace k3
