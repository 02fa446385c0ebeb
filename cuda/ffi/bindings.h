// The operands, attributes and results of the two custom calls, bound once for both
// platforms: the CPU handlers bind them as they are; the CUDA handlers bind the stream
// first and, in the backward, one more workspace result. Python's side of this contract is
// jax_flash/_primitives.py.
#pragma once

#include <utility>

#include "ffi_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

template <typename Binding>
auto bind_fwd(Binding b) {
  using ::xla::ffi::AnyBuffer;
  return std::move(b)
      .template Arg<AnyBuffer>()  // q [B, T, N, H]
      .template Arg<AnyBuffer>()  // k [B, S, K, H]
      .template Arg<AnyBuffer>()  // v [B, S, K, H]
      .template Arg<AnyBuffer>()  // q_lens int32 [B] or [0]
      .template Arg<AnyBuffer>()  // kv_lens int32 [B] or [0]
      .template Attrs<FlashAttrs>()
      .template Ret<AnyBuffer>()   // o [B, T, N, H]
      .template Ret<AnyBuffer>();  // lse float32 [B, N, T]
}

template <typename Binding>
auto bind_bwd(Binding b) {
  using ::xla::ffi::AnyBuffer;
  return std::move(b)
      .template Arg<AnyBuffer>()  // q
      .template Arg<AnyBuffer>()  // k
      .template Arg<AnyBuffer>()  // v
      .template Arg<AnyBuffer>()  // o (forward output)
      .template Arg<AnyBuffer>()  // lse float32 [B, N, T]
      .template Arg<AnyBuffer>()  // do (cotangent of o)
      .template Arg<AnyBuffer>()  // q_lens int32 [B] or [0]
      .template Arg<AnyBuffer>()  // kv_lens int32 [B] or [0]
      .template Attrs<FlashAttrs>()
      .template Ret<AnyBuffer>()   // dq
      .template Ret<AnyBuffer>()   // dk
      .template Ret<AnyBuffer>()   // dv
      .template Ret<AnyBuffer>();  // workspace: dsum float32 [B, N, rows] (rows = dq_accum_rows(T))
}

// The optional element-wise inputs, bound after everything above (and after the CUDA backward's
// extra workspaces); both platforms' handlers take them, and both backwards then return dbias
// last. Absent ones arrive as zero-size buffers.
template <typename Binding>
auto bind_extras(Binding b) {
  using ::xla::ffi::AnyBuffer;
  return std::move(b)
      .template Arg<AnyBuffer>()   // q_segment_ids int32 [B, T] or [0]
      .template Arg<AnyBuffer>()   // kv_segment_ids int32 [B, S] or [0]
      .template Arg<AnyBuffer>()   // bias float [Bb, Nb, Tb, Sb] (each dim 1 or full) or [0]
      .template Arg<AnyBuffer>()   // mask bool [Bm, Nm, Tm, Sm] (each dim 1 or full) or [0]
      .template Arg<AnyBuffer>();  // dropout keys uint32 [B, N, 4] (see FlashFwdParams) or [0]
}

}  // namespace jax_flash
