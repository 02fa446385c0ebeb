"""jax_flash as the attention of Flax modules.

    import flax.linen as nn, jax_flash.flax
    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=jax_flash.flax.dot_product_attention)
    flax.nnx.MultiHeadAttention(..., attention_fn=jax_flash.flax.dot_product_attention)

`dot_product_attention` accepts every argument those modules pass. What jax_flash's kernels
compute exactly (no mask and no bias, causal through `is_causal`, no active dropout) runs
on the kernels; everything else (a dense `mask` or `bias`, active dropout, the linen decode
cache's mask) runs Flax's own attention, `flax.linen.dot_product_attention`, unchanged, and
says so once with a `JaxFlashFallbackWarning`. Masks are traced arrays inside a jitted
module, so their values cannot be inspected to recognise a causal or padding mask; use
`causal_attention` (linen's module has no `is_causal`) and drop the mask to get the kernel.
Asking for the attention weights (`module` set, i.e. `sow_weights=True`) is an error: the
kernels never form them.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax.numpy as jnp

from . import attention as _attention

__all__ = ["dot_product_attention", "causal_attention", "JaxFlashFallbackWarning"]


class JaxFlashFallbackWarning(UserWarning):
    """An argument made jax_flash.flax run Flax's own (XLA) attention for this call."""


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    force_fp32_for_softmax: bool = False,
    is_causal: bool = False,
    **einsums,
):
    """Flax's `attention_fn` signature: query [..., T, N, H], key/value [..., S, K, H].

    Runs jax_flash when the call is one its kernels compute exactly, Flax's own attention
    otherwise (see the module docstring). `dtype` casts query/key/value (as Flax does);
    `precision` and `force_fp32_for_softmax` need nothing: the kernels multiply with float32
    accumulation and do the softmax in float32. Extra `einsums` (AQT's einsum overrides)
    force the fallback, where they are honoured.
    """
    if module is not None:
        raise ValueError(
            "jax_flash.flax.dot_product_attention cannot return attention weights (the module "
            "asked to sow them, sow_weights=True); use Flax's default attention_fn for that call"
        )
    dropout_active = dropout_rate > 0.0 and not deterministic
    reasons = [name for name, used in (
        ("mask", mask is not None),
        ("bias", bias is not None),
        ("dropout", dropout_active),
        ("einsum overrides", any(f is not None for f in einsums.values())),
    ) if used]
    if reasons:
        warnings.warn(
            f"jax_flash.flax: {', '.join(reasons)} not supported by the kernels yet; this call "
            "runs flax.linen.dot_product_attention (XLA, materialises the attention matrix)",
            JaxFlashFallbackWarning, stacklevel=2,
        )
        return _flax_attention(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                               deterministic, dtype, precision, force_fp32_for_softmax, is_causal, einsums)

    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))  # dtype None: unchanged
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"query/key/value must be [..., L, heads, head_dim] of one rank, got {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query/key/value batch dims differ: {query.shape}, {key.shape}, {value.shape}")
    # Any number of batch dims (Flax allows several) folds into the kernel's one.
    flat = lambda x: x.reshape((math.prod(batch),) + x.shape[-3:])
    out = _attention.dot_product_attention(flat(query), flat(key), flat(value), is_causal=is_causal)
    return out.reshape(batch + out.shape[1:])


causal_attention = functools.partial(dot_product_attention, is_causal=True)
causal_attention.__doc__ = """`dot_product_attention` with is_causal=True: for linen's
MultiHeadDotProductAttention, which has no is_causal argument (call it without the causal mask)."""


def _flax_attention(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                    deterministic, dtype, precision, force_fp32_for_softmax, is_causal, einsums):
    import flax.linen as nn  # only needed on the fallback path

    if is_causal:  # nnx passes is_causal; Flax's linen function has no such flag
        if key.shape[-3] != query.shape[-3]:
            raise ValueError("is_causal with query and key of different lengths: pass a mask instead")
        causal = nn.make_causal_mask(jnp.zeros(query.shape[:-3] + (query.shape[-3],)), dtype=jnp.bool_)
        mask = causal if mask is None else nn.combine_masks(mask, causal)
    return nn.dot_product_attention(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
        precision=precision, force_fp32_for_softmax=force_fp32_for_softmax, **einsums,
    )
