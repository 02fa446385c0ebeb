// Dispatch: picks the (head_dim, dtype) instantiation, or cudaErrorNotSupported so the caller
// falls back to the portable sm80 path.
#include <cstdint>

#include "flash_sm90.h"
#include "segments.h"
#include "support.h"
#include "timeline.h"

namespace jax_flash {

#ifdef JF_FWD_TIMELINE
uint32_t* sm90::g_fwd_timeline = nullptr;
#endif

template <int kHeadDim, DType kDType>
cudaError_t flash_fwd_sm90_hdim(const FlashFwdParams& p, cudaStream_t stream);

cudaError_t flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream) {
  int const hd = sm90::padded_head_dim(p.head_dim);
  if (hd == 0) return cudaErrorNotSupported;
  // Window / length arithmetic is done in 64-bit; the softcap variant needs softcap > 0 only.
  if (!sm90::fwd_operands_ok(p) || !sm90::on_sm90()) return cudaErrorNotSupported;
  if (!hopper_fwd_takes_extras(p)) return cudaErrorNotSupported;
  if (p.q_segment_ids) {
    cudaError_t err = sm90::compute_segment_ranges(sm90::query_chunk_sides(p), p.batch, stream);
    if (err != cudaSuccess) return err;
  }
  const bool bf16 = p.dtype == DType::kBFloat16;
#ifdef JF_HARNESS_BF16_HDIM  // harness A/B builds of one instantiation (build_harness.sh HDIM=...)
  if (hd != JF_HARNESS_BF16_HDIM || !bf16) return cudaErrorNotSupported;
  return flash_fwd_sm90_hdim<JF_HARNESS_BF16_HDIM, DType::kBFloat16>(p, stream);
#endif
  switch (hd) {
    case 64: return bf16 ? flash_fwd_sm90_hdim<64, DType::kBFloat16>(p, stream) : flash_fwd_sm90_hdim<64, DType::kFloat16>(p, stream);
    case 128: return bf16 ? flash_fwd_sm90_hdim<128, DType::kBFloat16>(p, stream) : flash_fwd_sm90_hdim<128, DType::kFloat16>(p, stream);
    case 256: return bf16 ? flash_fwd_sm90_hdim<256, DType::kBFloat16>(p, stream) : flash_fwd_sm90_hdim<256, DType::kFloat16>(p, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace jax_flash
