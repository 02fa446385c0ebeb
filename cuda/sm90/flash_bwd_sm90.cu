// Dispatch of the sm90 backward: picks the (head_dim, dtype) instantiation, or
// cudaErrorNotSupported so the caller falls back to the portable sm80 path.
#include <cstdint>

#include "flash_bwd_sm90.h"

namespace jax_flash {

template <int kHeadDim, DType kDType>
cudaError_t flash_bwd_sm90_hdim(const FlashBwdParams& p, cudaStream_t stream);

namespace {
bool bwd_aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
// TMA: global strides (bytes) must be multiples of 16; 2-byte elements -> multiples of 8.
bool bwd_stride_ok(int64_t s) { return s >= 0 && s % 8 == 0 && s < (int64_t(1) << 38); }
int bwd_device_cc() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor;
}
}  // namespace

cudaError_t flash_bwd_sm90(const FlashBwdParams& p, cudaStream_t stream) {
  if (p.deterministic) return cudaErrorNotSupported;  // sm80 has the deterministic mode
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (p.head_dim != 128) return cudaErrorNotSupported;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0)
    return cudaErrorNotSupported;
  if (!p.dq_accum || !p.dsum || !p.lse) return cudaErrorNotSupported;
  const void* ptrs[] = {p.q, p.k, p.v, p.o, p.dout, p.dq, p.dk, p.dv, p.dq_accum};
  for (const void* q : ptrs)
    if (!bwd_aligned16(q)) return cudaErrorNotSupported;
  const int64_t strides[] = {p.q_batch_stride,  p.q_row_stride,  p.q_head_stride,  p.k_batch_stride,  p.k_row_stride,
                             p.k_head_stride,   p.v_batch_stride, p.v_row_stride,   p.v_head_stride,   p.o_batch_stride,
                             p.o_row_stride,    p.o_head_stride,  p.do_batch_stride, p.do_row_stride,  p.do_head_stride,
                             p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride, p.dk_batch_stride, p.dk_row_stride,
                             p.dk_head_stride,  p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride};
  for (int64_t s : strides)
    if (!bwd_stride_ok(s)) return cudaErrorNotSupported;
  static thread_local int cc = -2;
  if (cc == -2) cc = bwd_device_cc();
  if (cc != 90) return cudaErrorNotSupported;
  const bool bf16 = p.dtype == DType::kBFloat16;
  return bf16 ? flash_bwd_sm90_hdim<128, DType::kBFloat16>(p, stream) : flash_bwd_sm90_hdim<128, DType::kFloat16>(p, stream);
}

}  // namespace jax_flash
