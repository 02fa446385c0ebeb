"""jax_flash: FlashAttention for JAX as XLA FFI custom calls (CPU, portable CUDA, Hopper)."""

from . import _ffi  # registers the FFI targets
from .attention import JaxFlashFallbackWarning, dot_product_attention, flash_attention
from ._ffi import WITH_CUDA
from .ring import ring_attention, ring_attention_shard, unzigzag, zigzag

__version__ = "0.1.0"


def export_disabled_checks():
    """The `disabled_checks` that `jax.export.export` needs for jax_flash's custom calls.

    jax.export only serialises custom calls it knows to be stable; jax_flash's targets are
    versioned with this package, so the exported artefact must be run with the same
    jax_flash installed (and its targets registered, i.e. `import jax_flash`).
    """
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(t) for t in (_ffi.FWD_TARGET, _ffi.BWD_TARGET)]


__all__ = [
    "dot_product_attention", "flash_attention", "export_disabled_checks", "WITH_CUDA",
    "JaxFlashFallbackWarning",
    "ring_attention", "ring_attention_shard", "zigzag", "unzigzag",
]
