"""Loads the native extension and registers its XLA FFI targets with JAX."""

from __future__ import annotations

import jax

from . import _jax_flash

FWD_TARGET = "jax_flash_fwd"
BWD_TARGET = "jax_flash_bwd"

#: True when the extension was built with the CUDA kernels.
WITH_CUDA: bool = bool(_jax_flash.with_cuda)

for _platform, _targets in _jax_flash.registrations().items():
    # JAX keeps registrations for a platform whose backend is not (yet) initialised, so
    # registering CUDA targets on a CPU-only install is harmless.
    for _name, _capsule in _targets.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)
