// The GPU dQ accumulator's padded shape and the Hopper backward's int32 workspace without segment
// ids (flash_params.h), printed for the Python mirrors (_primitives._dq_accum_shape and
// _bwd_workspace_ints size the FFI output buffers) to compare. Built and run by
// tests/test_mask_cpp.py.
#include <cstdio>
#include <initializer_list>

#include "common/flash_params.h"

int main() {
  for (int t = 1; t <= 2000; ++t) std::printf("rows %d %lld\n", t, static_cast<long long>(jax_flash::dq_accum_rows(t)));
  for (int h = 1; h <= 320; ++h) std::printf("cols %d %lld\n", h, static_cast<long long>(jax_flash::dq_accum_cols(h)));
  for (int b : {1, 3})
    for (int k : {1, 2, 8})
      for (int s = 1; s <= 20000; s += 97)
        std::printf("bwd_ws_%d_%d %d %lld\n", b, k, s, static_cast<long long>(jax_flash::bwd_workspace_ints(b, k, s, false)));
  return 0;
}
