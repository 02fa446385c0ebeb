// XLA FFI handlers of the CUDA backend: decode, fill params, pick a kernel family, launch
// on XLA's stream. No synchronisation and no allocation (workspaces are extra FFI
// outputs), so the handlers are marked CUDA-graph compatible.
// The optional inputs (segment ids, bias, mask, dropout) and dbias are implemented by the
// portable sm80 kernels; which of them the Hopper kernels take: check_extras_kernel.
#include <cuda_runtime.h>

#include <string>

#include "../common/mask.h"
#include "../sm80/flash_sm80.h"
#ifdef JAX_FLASH_WITH_SM90
#include "../sm90/flash_bwd_sm90.h"
#include "../sm90/flash_sm90.h"
#include "../sm90/support.h"
#endif
#include "bindings.h"
#include "handlers.h"
#include "kernel_log.h"

namespace ffi = ::xla::ffi;

namespace jax_flash {
namespace {

enum Kernel : int32_t { kAuto = 0, kPortable = 1, kHopper = 2 };

ffi::Error to_ffi(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_flash: ") + what + " failed: " + cudaGetErrorString(err));
}

ffi::Error check_gpu_supported(const FlashFwdParams& p) {
  if (p.dtype == DType::kFloat32)
    return ffi::Error::InvalidArgument(
        "jax_flash: float32 inputs are not supported on the GPU; cast to bfloat16 or float16");
  if (p.head_dim > 256)
    return ffi::Error::InvalidArgument("jax_flash: head_dim > 256 is not supported on the GPU");
  return ffi::Error::Success();
}

// True when the Hopper kernels should run (and were built).
bool want_hopper(int32_t kernel) {
#ifdef JAX_FLASH_WITH_SM90
  if (kernel == kHopper) return true;
  return kernel == kAuto && sm90::on_sm90();
#else
  (void)kernel;
  return false;
#endif
}

// The launch's status, logged by name when it ran (kernel_log.h).
cudaError_t logged(cudaError_t err, const char* what, const FlashFwdParams& p) {
  if (err == cudaSuccess) log_kernel(what, p);
  return err;
}

// kernel='hopper' on a build without the sm90 kernels is an error, not a silent fallback.
ffi::Error check_kernel_built(int32_t kernel) {
  if (kernel == kHopper && !want_hopper(kernel))
    return ffi::Error::InvalidArgument("jax_flash: kernel='hopper' requested but the sm90 kernels were not built");
  return ffi::Error::Success();
}

// kernel='auto' sends the Hopper kernels the optional inputs they take (hopper_fwd_preferred,
// hopper_bwd_takes_extras, flash_params.h: the forward any mix, dropout alone; the backward one
// kind at a time, without softcap or the deterministic mode) and the portable kernels the rest.
// kernel='hopper' with any of them is an error (Python raises it first, at lowering).
ffi::Error check_extras_kernel(const FlashFwdParams& p, int32_t kernel) {
  if (has_extras(p) && kernel == kHopper)
    return ffi::Error::InvalidArgument(
        "jax_flash: kernel='hopper' does not take segment ids, bias, mask or dropout; use kernel='auto' (the Hopper "
        "kernels where they take these inputs, else the portable ones) or 'portable'");
  return ffi::Error::Success();
}

ffi::Error FwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens, FlashAttrs attrs,
                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, ffi::AnyBuffer q_seg,
                   ffi::AnyBuffer kv_seg, ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer dropout_keys,
                   ffi::Result<ffi::AnyBuffer> tile_counter) {
  FlashFwdParams p;
  if (auto e = fill_fwd_params(q, k, v, q_lens, kv_lens, attrs, &p); e.failure()) return e;
  if (auto e = fill_extra_params(q_seg, kv_seg, bias, mask, dropout_keys, attrs, &p); e.failure()) return e;
  if (auto e = check_gpu_supported(p); e.failure()) return e;
  p.o = o->untyped_data();
  p.lse = static_cast<float*>(lse->untyped_data());
  if (p.batch == 0) return ffi::Error::Success();  // empty batch: nothing to write (no zero grids)
  p.tile_counter = static_cast<int32_t*>(tile_counter->untyped_data());
  // The lowering sizes the workspace for the segment ranges when segment ids are given.
  bool const workspace_ok = int64_t(tile_counter->element_count()) >=
                            workspace_ints(p.batch, p.seqlen_q, p.q_segment_ids != nullptr);
  if (auto e = check_kernel_built(attrs.kernel); e.failure()) return e;
  if (auto e = check_extras_kernel(p, attrs.kernel); e.failure()) return e;
#ifdef JAX_FLASH_WITH_SM90
  if (want_hopper(attrs.kernel) && hopper_fwd_preferred(p) && workspace_ok) {
    // "tiles": the bias / mask tiles come by TMA (sm90/dense_tma.h).
    cudaError_t err = logged(flash_fwd_sm90(p, stream), dense_tiles_by_tma(p) ? "forward hopper tiles" : "forward hopper", p);
    if (err != cudaErrorNotSupported || attrs.kernel == kHopper) return to_ffi(err, "flash_fwd_sm90");
    cudaGetLastError();  // clear the not-supported status before falling back
  }
#endif
  return to_ffi(logged(flash_fwd_sm80(p, stream), "forward portable", p), "flash_fwd_sm80");
}

ffi::Error BwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer q_lens,
                   ffi::AnyBuffer kv_lens, FlashAttrs attrs, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::AnyBuffer> dsum, ffi::Result<ffi::AnyBuffer> lse_log2,
                   ffi::Result<ffi::AnyBuffer> dq_semaphore, ffi::Result<ffi::AnyBuffer> dq_accum,
                   ffi::AnyBuffer q_seg, ffi::AnyBuffer kv_seg, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                   ffi::AnyBuffer dropout_keys, ffi::Result<ffi::AnyBuffer> dbias,
                   ffi::Result<ffi::AnyBuffer> seg_workspace) {
  FlashBwdParams p;
  if (auto e = fill_bwd_params(q, k, v, o, lse, dout, q_lens, kv_lens, attrs, &p); e.failure()) return e;
  if (auto e = fill_extra_params(q_seg, kv_seg, bias, mask, dropout_keys, attrs, &p); e.failure()) return e;
  if (auto e = fill_dbias_params(*dbias, &p); e.failure()) return e;
  if (auto e = check_gpu_supported(p); e.failure()) return e;
  // dbias over a broadcast axis is summed with float atomics (flash_bwd_kernel_sm80.h): refuse
  // deterministic=True there rather than return run-to-run different bits.
  if (p.dbias && p.deterministic && dbias_is_reduced(p))
    return ffi::Error::InvalidArgument(
        "jax_flash: deterministic=True is not supported with a bias broadcast over batch, heads, queries or keys "
        "(its gradient is summed with float atomics on the GPU); pass a full-size bias or deterministic=False");
  // dbias is a float32 sum over the bias's broadcast axes (REDs in either backward): zeroed here,
  // once, whichever kernel runs; an empty batch gets just that (a zero gradient).
  if (size_t const n = dbias->size_bytes()) {
    if (auto e = to_ffi(cudaMemsetAsync(dbias->untyped_data(), 0, n, stream), "zeroing dbias"); e.failure()) return e;
  }
  if (p.batch == 0) return ffi::Error::Success();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dsum = static_cast<float*>(dsum->untyped_data());
  p.lse_log2 = static_cast<float*>(lse_log2->untyped_data());
  p.dq_semaphore = static_cast<int*>(dq_semaphore->untyped_data());
  p.dq_accum = static_cast<float*>(dq_accum->untyped_data());
  // Segment ids: the Hopper backward's key-chunk ranges (and its tile counter); without them,
  // the split tail's slots (and the tile counter); each when the lowering sized the workspace
  // for them (flash_params.h: workspace_ints, bwd_workspace_ints).
  int64_t const ws_ints = int64_t(seg_workspace->element_count());
  if (p.q_segment_ids ? ws_ints >= workspace_ints(p.batch, p.seqlen_k, true)
                      : bwd_split_slots(p.batch, p.heads_kv, p.seqlen_k) > 0 &&
                            ws_ints >= bwd_workspace_ints(p.batch, p.heads_kv, p.seqlen_k, false))
    p.tile_counter = static_cast<int32_t*>(seg_workspace->untyped_data());
  if (auto e = check_kernel_built(attrs.kernel); e.failure()) return e;
  if (auto e = check_extras_kernel(p, attrs.kernel); e.failure()) return e;
#ifdef JAX_FLASH_WITH_SM90
  // The Hopper backward covers head dims that are multiples of 8 up to 256 except 129..192
  // (sm90::padded_head_dim); the others take the portable backward even under kernel='hopper'.
  if (want_hopper(attrs.kernel) && hopper_bwd_takes_extras(p)) {
    cudaError_t err =
        logged(flash_bwd_sm90(p, stream), dense_bwd_tiles_by_tma(p) ? "backward hopper tiles" : "backward hopper", p);
    if (err != cudaErrorNotSupported) return to_ffi(err, "flash_bwd_sm90");
    cudaGetLastError();  // clear the not-supported status before falling back
  }
#endif
  return to_ffi(logged(flash_bwd_sm80(p, stream), "backward portable", p), "flash_bwd_sm80");
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashFwdCuda, jax_flash::FwdCuda,
                              jax_flash::bind_extras(
                                  jax_flash::bind_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()))
                                  .Ret<ffi::AnyBuffer>(),  // workspace: tile counter [+ segment ranges] int32 (workspace_ints)
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBwdCuda, jax_flash::BwdCuda,
                              jax_flash::bind_extras(
                                  jax_flash::bind_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                      .Ret<ffi::AnyBuffer>()   // workspace: lse_log2 float32 [B, N, rows]
                                      .Ret<ffi::AnyBuffer>()   // workspace: dq_semaphore int32 [B, N, rows / 64]
                                      .Ret<ffi::AnyBuffer>())  // workspace: dq_accum float32 [B, N, rows, cols]
                                  .Ret<ffi::AnyBuffer>()       // dbias float32, bias's shape, or [0]
                                  .Ret<ffi::AnyBuffer>(),      // workspace: segment ranges int32 (workspace_ints)
                              {ffi::Traits::kCmdBufferCompatible});
