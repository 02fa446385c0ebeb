#pragma once
#include <cuda_runtime.h>
#include "../common/flash_params.h"
namespace jax_flash {
// Returns cudaErrorInvalidValue for configurations it does not support (dtype float32, head_dim > 256).
cudaError_t flash_fwd_sm80(const FlashFwdParams& p, cudaStream_t stream);
cudaError_t flash_bwd_sm80(const FlashBwdParams& p, cudaStream_t stream);
}
