// The XLA FFI handler symbols (extern "C") the nanobind module exposes as capsules.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCpu);
#ifdef JAX_FLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashBwdCuda);
#endif
