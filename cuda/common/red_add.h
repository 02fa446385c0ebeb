// Vector float reductions into global memory (red.global.add.v2 / .v4, sm_90), shared by the
// portable backward's dQ and the Hopper backward's split-tail dK / dV. sm_80: scalar atomics.
// The "memory" clobber keeps them on their side of the fences that publish them.
#pragma once

namespace jax_flash {

__device__ __forceinline__ void red_add_f32x2(float* ptr, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(ptr, x);
  atomicAdd(ptr + 1, y);
#endif
}

__device__ __forceinline__ void red_add_f32x4(float* ptr, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
#else
  atomicAdd(ptr, x);
  atomicAdd(ptr + 1, y);
  atomicAdd(ptr + 2, z);
  atomicAdd(ptr + 3, w);
#endif
}

}  // namespace jax_flash
