// XLA FFI handlers of the CPU backend: decode, fill params, run the kernel.
#include "../cpu/flash_cpu.h"
#include "bindings.h"
#include "handlers.h"
#include "kernel_log.h"

namespace ffi = ::xla::ffi;

namespace jax_flash {

namespace {

ffi::Error FwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer q_lens,
                  ffi::AnyBuffer kv_lens, FlashAttrs attrs, ffi::Result<ffi::AnyBuffer> o,
                  ffi::Result<ffi::AnyBuffer> lse, ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer bias,
                  ffi::AnyBuffer mask, ffi::AnyBuffer dropout_keys) {
  FlashFwdParams p;
  if (auto e = fill_fwd_params(q, k, v, q_lens, kv_lens, attrs, &p); e.failure()) return e;
  if (auto e = fill_extra_params(q_seg, kv_seg, bias, mask, dropout_keys, attrs, &p); e.failure()) return e;
  p.o = o->untyped_data();
  p.lse = static_cast<float*>(lse->untyped_data());
  cpu::flash_fwd(p);
  log_kernel("forward cpu", p);
  return ffi::Error::Success();
}

ffi::Error BwdCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                  ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                  FlashAttrs attrs, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                  ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dsum, ffi::AnyBuffer q_seg,
                  ffi::AnyBuffer kv_seg, ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_keys,
                  ffi::Result<ffi::AnyBuffer> dbias) {
  FlashBwdParams p;
  if (auto e = fill_bwd_params(q, k, v, o, lse, dout, q_lens, kv_lens, attrs, &p); e.failure()) return e;
  if (auto e = fill_extra_params(q_seg, kv_seg, bias, mask, dropout_keys, attrs, &p); e.failure()) return e;
  if (auto e = fill_dbias_params(*dbias, &p); e.failure()) return e;
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dsum = static_cast<float*>(dsum->untyped_data());
  cpu::flash_bwd(p);
  log_kernel("backward cpu", p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCpu, jax_flash::FwdCpu,
                              jax_flash::bind_extras(jax_flash::bind_fwd(ffi::Ffi::Bind())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCpu, jax_flash::BwdCpu,
                              jax_flash::bind_extras(jax_flash::bind_bwd(ffi::Ffi::Bind()))
                                  .Ret<ffi::AnyBuffer>());  // dbias float32, bias's shape, or [0]
