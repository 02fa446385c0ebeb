// One instantiation: backward, head_dim 256, bf16.
#include "flash_bwd_launch_sm90.h"

namespace jax_flash {
template <>
cudaError_t flash_bwd_sm90_hdim<256, DType::kBFloat16>(const FlashBwdParams& p, cudaStream_t stream) {
  return sm90::run_bwd_hdim<256, cutlass::bfloat16_t>(p, stream);
}
}  // namespace jax_flash
