// The GPU dQ accumulator's padded shape (flash_params.h), printed for the Python mirror
// (_primitives._dq_accum_shape sizes the FFI output buffer) to compare. Built and run by
// tests/test_mask_cpp.py.
#include <cstdio>

#include "common/flash_params.h"

int main() {
  for (int t = 1; t <= 2000; ++t) std::printf("rows %d %lld\n", t, static_cast<long long>(jax_flash::dq_accum_rows(t)));
  for (int h = 1; h <= 320; ++h) std::printf("cols %d %lld\n", h, static_cast<long long>(jax_flash::dq_accum_cols(h)));
  return 0;
}
