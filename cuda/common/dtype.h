// 16-bit float -> float32 conversions and a dtype-dispatched scalar load, shared by the CPU
// backend and the GPU kernels (which read the optional bias, of any of the three dtypes,
// one element at a time). Host code uses the bit-level routines; device code the intrinsics.
#pragma once

#include <cstdint>
#include <cstring>

#include "flash_params.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace jax_flash {

JF_HOST_DEVICE float float_from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

JF_HOST_DEVICE float bf16_to_float(uint16_t h) { return float_from_bits(uint32_t(h) << 16); }

JF_HOST_DEVICE float fp16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
      bits = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | man << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  return float_from_bits(bits);
#endif
}

// A load of a kernel input (no kernel writes it): the read-only data path on the GPU.
template <typename T>
JF_HOST_DEVICE T load_input(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// Element `offset` of the input `base` (of dtype), widened to float.
JF_HOST_DEVICE float load_float(const void* base, DType dtype, int64_t offset) {
  if (dtype == DType::kFloat32) return load_input(static_cast<const float*>(base) + offset);
  const uint16_t h = load_input(static_cast<const unsigned short*>(base) + offset);
  return dtype == DType::kBFloat16 ? bf16_to_float(h) : fp16_to_float(h);
}

}  // namespace jax_flash
