#pragma once
#include <cuda_runtime.h>
#include "../common/flash_params.h"
namespace jax_flash {
// Hopper backward. cudaErrorNotSupported for configurations this path does not take
// (caller falls back to sm80). No host sync, no allocation.
cudaError_t flash_bwd_sm90(const FlashBwdParams& p, cudaStream_t stream);
}
