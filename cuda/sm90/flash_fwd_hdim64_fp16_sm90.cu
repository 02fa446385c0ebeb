// One instantiation: head_dim 64, fp16.
#include "launch.h"

namespace jax_flash {
template <>
cudaError_t flash_fwd_sm90_hdim<64, DType::kFloat16>(const FlashFwdParams& p, cudaStream_t stream) {
  return sm90::run_fwd_hdim<64, cutlass::half_t>(p, stream);
}
}  // namespace jax_flash
