// Element conversions for the CPU backend: bf16/fp16 are stored as raw 16-bit words and
// widened to float32 for all arithmetic (the widening conversions live in common/dtype.h,
// shared with the GPU kernels' bias loads; the narrowing ones are CPU-only).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common/dtype.h"
#include "../common/flash_params.h"

namespace jax_flash::cpu {

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return uint16_t(bits >> 16);
}

inline uint16_t float_to_fp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  uint32_t absb = bits & 0x7fffffffu;
  if (absb > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (absb >= 0x477ff000u) return sign | 0x7c00u;  // overflow (rounds to >= 65520) -> inf
  if (absb < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    float a;
    std::memcpy(&a, &absb, 4);
    // Units of 2^-24 rounded to nearest even by the FPU's default rounding.
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));
  }
  uint32_t rounded = absb + 0xfffu + ((absb >> 13) & 1u);
  return sign | uint16_t(((rounded >> 13) - ((127 - 15) << 10)) & 0xffffu);
}

// float16 -> float32 (F16C where the CPU has it, else fp16_to_float; tile.cc).
void widen_fp16(const uint16_t* s, int n, float* d);

// Widen n elements starting at src (of dtype) to float.
inline void load_row(const void* src, DType dtype, int64_t offset, int n, float* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      const float* s = static_cast<const float*>(src) + offset;
      for (int i = 0; i < n; ++i) dst[i] = s[i];
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
    case DType::kFloat16:
      widen_fp16(static_cast<const uint16_t*>(src) + offset, n, dst);
      break;
  }
}

// Narrow n floats to dtype and store at dst + offset.
inline void store_row(void* dst, DType dtype, int64_t offset, int n, const float* src) {
  switch (dtype) {
    case DType::kFloat32: {
      float* d = static_cast<float*>(dst) + offset;
      for (int i = 0; i < n; ++i) d[i] = src[i];
      break;
    }
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + offset;
      for (int i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
      break;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + offset;
      for (int i = 0; i < n; ++i) d[i] = float_to_fp16(src[i]);
      break;
    }
  }
}

}  // namespace jax_flash::cpu
