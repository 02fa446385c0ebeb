// Per-(dtype, head dim) entry points; each specialisation lives in its own .cu file so the
// build can pick a subset and compile them in parallel.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "../common/flash_params.h"

namespace jax_flash {
namespace sm80 {

template <typename Element, int kHeadDim>
cudaError_t run_fwd(const FlashFwdParams& p, cudaStream_t stream);
template <typename Element, int kHeadDim>
cudaError_t run_bwd(const FlashBwdParams& p, cudaStream_t stream);

}  // namespace sm80
}  // namespace jax_flash
