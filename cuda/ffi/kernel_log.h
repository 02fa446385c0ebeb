// JAX_FLASH_LOG_KERNELS=1: one stderr line per kernel launch of the FFI handlers, naming the
// kernels that ran (forward / backward; cpu, hopper or portable) and the call's optional inputs,
// so a user (and the tests) can see the routing. Read once per process.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "../common/flash_params.h"

namespace jax_flash {

inline bool log_kernels() {
  static bool const on = [] {
    char const* e = std::getenv("JAX_FLASH_LOG_KERNELS");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  return on;
}

// what: e.g. "forward hopper".
inline void log_kernel(const char* what, const FlashFwdParams& p) {
  if (!log_kernels()) return;
  std::fprintf(stderr, "jax_flash: %s head_dim=%d%s%s%s%s\n", what, p.head_dim, p.q_segment_ids ? " segment_ids" : "",
               p.bias ? " bias" : "", p.mask ? " mask" : "", p.dropout_keys ? " dropout" : "");
}

}  // namespace jax_flash
