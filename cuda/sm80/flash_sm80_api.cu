// Dispatch: validate, then pick the instantiation by dtype and head dim (rounded up to the
// next compiled head dim; padded columns are loaded as zeros and never stored).
#include <cstdint>
#include <type_traits>

#include "flash_sm80.h"
#include "flash_sm80_internal.h"
#include "../common/mask.h"

namespace jax_flash {
namespace {

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
// 16-byte vector loads/stores need every row start 8-element aligned.
bool strides_ok(int64_t a, int64_t b, int64_t c) { return a % 8 == 0 && b % 8 == 0 && c % 8 == 0; }

bool common_ok(const FlashFwdParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
  if (p.head_dim <= 0 || p.head_dim > 256 || p.head_dim % 8 != 0) return false;
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.heads_q < 0 || p.heads_kv <= 0) return false;
  if (p.heads_q % p.heads_kv != 0 || p.heads_q > 65535 || p.batch > 65535) return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o)) return false;
  if (!strides_ok(p.q_batch_stride, p.q_row_stride, p.q_head_stride) ||
      !strides_ok(p.k_batch_stride, p.k_row_stride, p.k_head_stride) ||
      !strides_ok(p.v_batch_stride, p.v_row_stride, p.v_head_stride) ||
      !strides_ok(p.o_batch_stride, p.o_row_stride, p.o_head_stride))
    return false;
  // Optional inputs: segment ids come in pairs; the bias is read one element at a time (any
  // alignment), in float32, bfloat16 or float16.
  if ((p.q_segment_ids == nullptr) != (p.kv_segment_ids == nullptr)) return false;
  if (p.bias && p.bias_dtype != DType::kFloat32 && p.bias_dtype != DType::kBFloat16 && p.bias_dtype != DType::kFloat16)
    return false;
  return true;
}

// Head dims 32 and 96 have their own instantiations (flash_*_hdim{32,96}_*.cu, listed as
// JF_SM80_OPTIONAL_SOURCES), but they were not run on a GPU yet, so by default those head dims
// run padded on the tested 64 / 128 kernels. Define JF_SM80_HDIM32 / JF_SM80_HDIM96 (and add
// the optional sources) to use them. JF_SM80_NO_FP16_HDIM256 drops fp16 x 256 (then reported
// as unsupported) for a faster build.
template <typename T, typename P, typename Fn>
cudaError_t by_head_dim(const P& p, Fn&& fn) {
#ifdef JF_SM80_HDIM32
  if (p.head_dim <= 32) return fn(std::integral_constant<int, 32>{});
#endif
  if (p.head_dim <= 64) return fn(std::integral_constant<int, 64>{});
#ifdef JF_SM80_HDIM96
  if (p.head_dim <= 96) return fn(std::integral_constant<int, 96>{});
#endif
  if (p.head_dim <= 128) return fn(std::integral_constant<int, 128>{});
#ifdef JF_SM80_NO_FP16_HDIM256
  if (std::is_same_v<T, cutlass::half_t>) return cudaErrorInvalidValue;
  else
#endif
  return fn(std::integral_constant<int, 256>{});
}

}  // namespace

cudaError_t flash_fwd_sm80(const FlashFwdParams& p, cudaStream_t stream) {
  if (!common_ok(p) || (p.batch * int64_t(p.heads_q) * p.seqlen_q > 0 && p.lse == nullptr)) return cudaErrorInvalidValue;
  if (p.dtype == DType::kBFloat16) {
    return by_head_dim<cutlass::bfloat16_t>(p, [&](auto hd) { return sm80::run_fwd<cutlass::bfloat16_t, decltype(hd)::value>(p, stream); });
  }
  return by_head_dim<cutlass::half_t>(p, [&](auto hd) { return sm80::run_fwd<cutlass::half_t, decltype(hd)::value>(p, stream); });
}

cudaError_t flash_bwd_sm80(const FlashBwdParams& p, cudaStream_t stream) {
  if (!common_ok(p)) return cudaErrorInvalidValue;
  if (!aligned16(p.dout) || !aligned16(p.dk) || !aligned16(p.dv)) return cudaErrorInvalidValue;
  if (!strides_ok(p.do_batch_stride, p.do_row_stride, p.do_head_stride) ||
      !strides_ok(p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) ||
      !strides_ok(p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride))
    return cudaErrorInvalidValue;
  if (p.batch * int64_t(p.heads_q) * p.seqlen_q > 0 && (p.dsum == nullptr || p.dq_accum == nullptr || p.lse == nullptr))
    return cudaErrorInvalidValue;
  if (p.dbias && !p.bias) return cudaErrorInvalidValue;
  // dbias summed over a broadcast axis uses float atomics in no fixed order: not deterministic.
  if (p.dbias && p.deterministic && dbias_is_reduced(p)) return cudaErrorNotSupported;
  // dq is written element-wise, so it has no alignment requirement.
  if (p.dtype == DType::kBFloat16) {
    return by_head_dim<cutlass::bfloat16_t>(p, [&](auto hd) { return sm80::run_bwd<cutlass::bfloat16_t, decltype(hd)::value>(p, stream); });
  }
  return by_head_dim<cutlass::half_t>(p, [&](auto hd) { return sm80::run_bwd<cutlass::half_t, decltype(hd)::value>(p, stream); });
}

}  // namespace jax_flash
