// XLA FFI handlers of the CPU backend: decode, fill params, run the kernel.
#include "../cpu/flash_cpu.h"
#include "ffi_params.h"
#include "handlers.h"

namespace ffi = ::xla::ffi;

namespace jax_flash {

namespace {

ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_lens,
                         ffi::AnyBuffer kv_lens, FlashAttrs attrs, ffi::Result<ffi::AnyBuffer> o,
                         ffi::Result<ffi::AnyBuffer> lse) {
  FlashFwdParams p;
  if (auto e = fill_fwd_params(q, k, v, q_lens, kv_lens, attrs, &p); e.failure()) return e;
  p.o = o->untyped_data();
  p.lse = static_cast<float*>(lse->untyped_data());
  cpu::flash_fwd(p);
  return ffi::Error::Success();
}

ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                         ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                         FlashAttrs attrs, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dsum) {
  FlashBwdParams p;
  if (auto e = fill_bwd_params(q, k, v, o, lse, dout, q_lens, kv_lens, attrs, &p); e.failure()) return e;
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dsum = static_cast<float*>(dsum->untyped_data());
  cpu::flash_bwd(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpu, jax_flash::FwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q [B, T, N, H]
                                  .Arg<ffi::AnyBuffer>()  // k [B, S, K, H]
                                  .Arg<ffi::AnyBuffer>()  // v [B, S, K, H]
                                  .Arg<ffi::AnyBuffer>()  // q_lens int32 [B] or [0]
                                  .Arg<ffi::AnyBuffer>()  // kv_lens int32 [B] or [0]
                                  .Attrs<jax_flash::FlashAttrs>()
                                  .Ret<ffi::AnyBuffer>()    // o [B, T, N, H]
                                  .Ret<ffi::AnyBuffer>());  // lse float32 [B, N, T]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpu, jax_flash::BwdCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // o (forward output)
                                  .Arg<ffi::AnyBuffer>()  // lse float32 [B, N, T]
                                  .Arg<ffi::AnyBuffer>()  // do (cotangent of o)
                                  .Arg<ffi::AnyBuffer>()  // q_lens int32 [B] or [0]
                                  .Arg<ffi::AnyBuffer>()  // kv_lens int32 [B] or [0]
                                  .Attrs<jax_flash::FlashAttrs>()
                                  .Ret<ffi::AnyBuffer>()    // dq
                                  .Ret<ffi::AnyBuffer>()    // dk
                                  .Ret<ffi::AnyBuffer>()    // dv
                                  .Ret<ffi::AnyBuffer>());  // workspace: dsum float32 [B, N, T]
