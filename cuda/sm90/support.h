// What the Hopper kernels can take: shared by the forward and backward dispatchers, which
// answer cudaErrorNotSupported (the caller then runs the portable sm80 path) otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/flash_params.h"

namespace jax_flash::sm90 {

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// TMA: global strides (bytes) must be multiples of 16; 2-byte elements -> multiples of 8.
inline bool tma_stride_ok(int64_t s) { return s >= 0 && s % 8 == 0 && s < (int64_t(1) << 38); }

// True on a compute capability 9.0 device (cached per device).
inline bool on_sm90() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cached[dev] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    cached[dev] = major * 10 + minor;
  }
  return cached[dev] == 90;
}

// The instantiation (64, 128 or 256) that runs a head dim, 0 for none. A smaller head dim runs
// zero-padded: TMA fills the columns past head_dim with zeros and the epilogues do not store
// them. head_dim must be a multiple of 8 (16-byte rows for TMA and the 16-byte row loads).
inline int padded_head_dim(int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return 0;
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// Multiprocessor count of the current device (persistent grids).
inline cudaError_t sm_count(int* sms) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  return err;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the previous
// kernel in the stream (PDL): its CTAs may be scheduled once every CTA of that kernel has called
// pdl_trigger (utils.h) or exited, so it must not rely on that kernel's results without its own
// synchronisation (pdl_wait, or counters with release / acquire).
template <class... Params, class... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args const&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, Params(args)...);
}

// Dtype, sizes, and q/k/v/o alignment and strides that every sm90 kernel needs.
inline bool fwd_operands_ok(const FlashFwdParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 ||
      p.heads_q % p.heads_kv != 0)
    return false;
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o)})
    if (!aligned16(ptr)) return false;
  for (int64_t s : {p.q_batch_stride, p.q_row_stride, p.q_head_stride, p.k_batch_stride, p.k_row_stride,
                    p.k_head_stride, p.v_batch_stride, p.v_row_stride, p.v_head_stride, p.o_batch_stride,
                    p.o_row_stride, p.o_head_stride})
    if (!tma_stride_ok(s)) return false;
  return true;
}

}  // namespace jax_flash::sm90
