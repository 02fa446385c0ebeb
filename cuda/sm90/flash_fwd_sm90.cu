// Dispatch: picks the (head_dim, dtype) instantiation, or cudaErrorNotSupported so the caller
// falls back to the portable sm80 path.
#include <cstdint>

#include "flash_sm90.h"

namespace jax_flash {

template <int kHeadDim, DType kDType>
cudaError_t flash_fwd_sm90_hdim(const FlashFwdParams& p, cudaStream_t stream);

namespace {
bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
// TMA: global strides (bytes) must be multiples of 16; 2-byte elements -> multiples of 8.
bool stride_ok(int64_t s) { return s >= 0 && s % 8 == 0 && s < (int64_t(1) << 38); }

int sm90_device_check() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor;
}
}  // namespace

cudaError_t flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return cudaErrorNotSupported;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0)
    return cudaErrorNotSupported;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o)) return cudaErrorNotSupported;
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride,
                             p.k_row_stride,   p.k_head_stride, p.v_batch_stride, p.v_row_stride,
                             p.v_head_stride,  p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides)
    if (!stride_ok(s)) return cudaErrorNotSupported;
  // Window / length arithmetic is done in 64-bit; the softcap variant needs softcap > 0 only.
  static thread_local int cc = -2;
  if (cc == -2) cc = sm90_device_check();
  if (cc != 90) return cudaErrorNotSupported;
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (p.head_dim) {
    case 64: return bf16 ? flash_fwd_sm90_hdim<64, DType::kBFloat16>(p, stream) : flash_fwd_sm90_hdim<64, DType::kFloat16>(p, stream);
    case 128: return bf16 ? flash_fwd_sm90_hdim<128, DType::kBFloat16>(p, stream) : flash_fwd_sm90_hdim<128, DType::kFloat16>(p, stream);
    case 256: return bf16 ? flash_fwd_sm90_hdim<256, DType::kBFloat16>(p, stream) : flash_fwd_sm90_hdim<256, DType::kFloat16>(p, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace jax_flash
