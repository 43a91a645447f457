// Storage dtypes that appear in K3 checkpoints, and exact conversions to float32.
// bf16 and f16 widen exactly to f32; f32 -> bf16 rounds to nearest even (NaN stays NaN).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace k3 {

enum class DType { F32, BF16, F16, U8, I64 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::U8: return 1;
    case DType::I64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::U8: return "U8";
    case DType::I64: return "I64";
  }
  return "?";
}

// Returns false for names k3cpp does not read (e.g. "F64", "I8").
bool dtype_from_name(const std::string& s, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t h);

// x[i] <- the bf16 value nearest x[i] (round to nearest even), kept as f32: what storing x as bf16 and
// reading it back gives.
inline void round_to_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

// Widen n elements of a float-like dtype (F32, BF16, F16) to f32.
void widen_to_f32(float* dst, const void* src, DType t, size_t n);

}  // namespace k3
