// One instantiation: head_dim 128, bf16.
#include "launch.h"

namespace jax_flash {
template <>
cudaError_t flash_fwd_sm90_hdim<128, DType::kBFloat16>(const FlashFwdParams& p, cudaStream_t stream) {
  return sm90::run_fwd_hdim<128, cutlass::bfloat16_t>(p, stream);
}
}  // namespace jax_flash
