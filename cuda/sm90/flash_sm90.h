#pragma once
#include <cuda_runtime.h>
#include "../common/flash_params.h"
namespace jax_flash {
// cudaErrorNotSupported for configurations this path does not take (caller falls back to sm80).
cudaError_t flash_fwd_sm90(const FlashFwdParams& p, cudaStream_t stream);
}
