// Dispatch of the sm90 backward: picks the (head_dim, dtype) instantiation, or
// cudaErrorNotSupported so the caller falls back to the portable sm80 path.
#include <cstdint>

#include "flash_bwd_sm90.h"
#include "segments.h"
#include "support.h"
#include "timeline.h"

namespace jax_flash {

#ifdef JF_BWD_TIMELINE
uint32_t* sm90::g_bwd_timeline = nullptr;
#endif

template <int kHeadDim, DType kDType>
cudaError_t flash_bwd_sm90_hdim(const FlashBwdParams& p, cudaStream_t stream);

cudaError_t flash_bwd_sm90(const FlashBwdParams& p, cudaStream_t stream) {
  if (p.deterministic && !p.dq_semaphore) return cudaErrorNotSupported;
  int const hd = sm90::padded_head_dim(p.head_dim);
  if (hd == 0 || !sm90::fwd_operands_ok(p)) return cudaErrorNotSupported;
  if (!p.dq_accum || !p.dsum || !p.lse || !p.lse_log2) return cudaErrorNotSupported;
  for (const void* ptr : {p.dout, static_cast<const void*>(p.dq), static_cast<const void*>(p.dk),
                          static_cast<const void*>(p.dv), static_cast<const void*>(p.dq_accum),
                          static_cast<const void*>(p.dsum), static_cast<const void*>(p.lse_log2)})
    if (!sm90::aligned16(ptr)) return cudaErrorNotSupported;
  for (int64_t s : {p.do_batch_stride, p.do_row_stride, p.do_head_stride, p.dq_batch_stride, p.dq_row_stride,
                    p.dq_head_stride, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, p.dv_batch_stride,
                    p.dv_row_stride, p.dv_head_stride})
    if (!sm90::tma_stride_ok(s)) return cudaErrorNotSupported;
  if (!sm90::on_sm90()) return cudaErrorNotSupported;
  if (!hopper_bwd_takes_extras(p)) return cudaErrorNotSupported;
  if (p.q_segment_ids) {
    cudaError_t err = sm90::compute_segment_ranges(sm90::key_chunk_sides(p), p.batch, stream);
    if (err != cudaSuccess) return err;
  }
  const bool bf16 = p.dtype == DType::kBFloat16;
#ifdef JF_HARNESS_BF16_HDIM  // harness A/B builds of one instantiation (build_harness.sh HDIM=...)
  if (hd != JF_HARNESS_BF16_HDIM || !bf16) return cudaErrorNotSupported;
  return flash_bwd_sm90_hdim<JF_HARNESS_BF16_HDIM, DType::kBFloat16>(p, stream);
#endif
  if (hd == 64)
    return bf16 ? flash_bwd_sm90_hdim<64, DType::kBFloat16>(p, stream) : flash_bwd_sm90_hdim<64, DType::kFloat16>(p, stream);
  if (hd == 128)
    return bf16 ? flash_bwd_sm90_hdim<128, DType::kBFloat16>(p, stream) : flash_bwd_sm90_hdim<128, DType::kFloat16>(p, stream);
  return bf16 ? flash_bwd_sm90_hdim<256, DType::kBFloat16>(p, stream) : flash_bwd_sm90_hdim<256, DType::kFloat16>(p, stream);
}

}  // namespace jax_flash
