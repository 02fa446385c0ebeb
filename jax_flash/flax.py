"""jax_flash as the attention of Flax modules.

    import flax.linen as nn, jax_flash.flax
    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=jax_flash.flax.dot_product_attention)
    flax.nnx.MultiHeadAttention(..., attention_fn=jax_flash.flax.dot_product_attention)

`dot_product_attention` accepts every argument those modules pass and does, per call:
- no mask: the kernels (causal through `is_causal`, or `causal_attention` for linen's module,
  which has no `is_causal`);
- a `mask` (bool or 0/1 float): masks are traced arrays inside a jitted module, so the choice
  is made on the device, by `lax.cond`. When every row of batch b sees exactly the keys
  [0, L_b) with L_b >= 1 (key padding from `make_attention_mask`, the linen / nnx decode
  cache's `arange(max_length) <= cur_index` mask), the kernels run with
  `key_value_seq_lengths=L` and only read the L_b live keys; any other mask runs Flax's own
  attention. Both give Flax's result (a fully masked row is the one case they would disagree
  on, so it goes to Flax). On a GPU, inputs the kernels do not take there (float32, head dims
  over 256) run Flax's attention directly, as they did before masks took the kernels;
- active dropout (`dropout_rate > 0` and not `deterministic`) runs in the kernels on every
  platform (on a GPU the portable sm80 kernels, which drop exactly what the CPU kernels drop
  for the same key), with either of the above;
- a `bias` (added to the scaled logits, as Flax does) runs in the kernels with any of the
  above, its gradient included: on a GPU the portable (sm80) kernels, which read the bias tile
  by tile (the Hopper kernels take no bias). Inputs the GPU kernels do not take (float32, head
  dims over 256) with a bias run `flax.linen.dot_product_attention` when lowered for a GPU
  (chosen per platform at lowering, with a `JaxFlashFallbackWarning` at trace time when the
  default backend is not the CPU), the CPU kernels on the CPU.
The kernels' dropout draws its mask from jax_flash's own counter-based RNG keyed by
`dropout_rng` (see `jax_flash.dot_product_attention`), not from `jax.random.bernoulli`, so
under dropout the result is a different (equally distributed) sample than Flax's attention
with the same key: same key, same mask, but not Flax's mask. `broadcast_dropout=True` (Flax's
default) is honoured exactly: one [q_length, kv_length] mask shared by every batch element and
head. A mask that is not a key prefix sends the call to Flax's attention, dropout included
(Flax's own mask there).
Extra `einsums` (AQT's einsum overrides) run Flax's attention, with a warning.
Asking for the attention weights (`module` set, i.e. `sow_weights=True`) is an error: the
kernels never form them. A causal mask passed as a mask is not a key prefix and so takes
Flax's attention: pass `is_causal` (or use `causal_attention`) instead.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from . import _primitives
from . import attention as _attention

__all__ = ["dot_product_attention", "causal_attention", "JaxFlashFallbackWarning"]


# An argument made jax_flash.flax run Flax's own (XLA) attention for this call (shared with
# jax_flash.dot_product_attention's GPU fallback).
JaxFlashFallbackWarning = _attention.JaxFlashFallbackWarning


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

    Runs jax_flash when the call is one its kernels compute (exactly, or under dropout with
    its own RNG, on the CPU and the GPU), Flax's own attention otherwise (see the module docstring). `dtype` casts
    query/key/value (as Flax does);
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
    flax_attention = lambda q, k, v: _flax_attention(
        q, k, v, bias, mask, broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision,
        force_fp32_for_softmax, is_causal, einsums)
    if any(f is not None for f in einsums.values()):
        warnings.warn(
            "jax_flash.flax: einsum overrides are not taken by the adapter's kernel path; this call "
            "runs flax.linen.dot_product_attention (XLA, materialises the attention matrix)",
            JaxFlashFallbackWarning, stacklevel=2,
        )
        return flax_attention(query, key, value)

    # The bias and dropout ride along to _kernel_attention.
    extras = {}
    if bias is not None:
        extras["bias"] = bias
    if dropout_active:
        extras.update(dropout_rate=dropout_rate, dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout)
    if mask is not None:
        run = functools.partial(_masked_attention, mask=mask, flax_attention=flax_attention, extras=extras)
    else:
        run = functools.partial(_kernel_attention, **extras)
    out_dtype = jnp.asarray(query, dtype).dtype  # the kernels' output dtype
    if bias is None or mask is not None or _primitives.gpu_kernels_take(out_dtype, query.shape[-1]):
        # Dropout runs in the kernels on every platform; a bias too where the GPU kernels take
        # the dtype / head dim (a mask decides for itself, in _masked_attention).
        return run(query, key, value, dtype=dtype, is_causal=is_causal)

    # A bias with inputs the GPU kernels do not take (float32, head dims over 256): the CPU
    # kernels, and Flax's attention when lowered for a GPU (chosen per platform at lowering).
    if jax.default_backend() != "cpu":
        warnings.warn(
            f"jax_flash.flax: the GPU kernels take bfloat16 / float16 and head dims up to 256, got "
            f"{out_dtype} / {query.shape[-1]} with a bias; lowered for a GPU this call runs "
            "flax.linen.dot_product_attention (XLA, materialises the attention matrix)",
            JaxFlashFallbackWarning, stacklevel=2,
        )
    return jax.lax.platform_dependent(
        query, key, value, cpu=lambda q, k, v: run(q, k, v, dtype=dtype, is_causal=is_causal),
        default=lambda q, k, v: flax_attention(q, k, v).astype(out_dtype))


def _check_shapes(query, key, value):
    """[..., L, heads, head_dim] operands of one rank with the same batch dims."""
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"query/key/value must be [..., L, heads, head_dim] of one rank, got {query.shape}, "
            f"{key.shape}, {value.shape}"
        )
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query/key/value batch dims differ: {query.shape}, {key.shape}, {value.shape}")


def _kernel_attention(query, key, value, dtype, is_causal, kv_lengths=None, bias=None, **dropout):
    """The kernels; kv_lengths (int32, batch dims flattened) bounds the keys each batch sees.
    bias: Flax's, broadcastable to [batch..., heads, q_length, kv_length]; dropout: the
    dropout_rate / dropout_rng / broadcast_dropout arguments of jax_flash.dot_product_attention."""
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))  # dtype None: unchanged
    _check_shapes(query, key, value)
    batch = query.shape[:-3]
    # Any number of batch dims (Flax allows several) folds into the kernel's one.
    flat = lambda x: x.reshape((math.prod(batch),) + x.shape[-3:])
    if bias is not None:
        bias = _flat_bias(bias, batch, query.shape[-2], query.shape[-3], key.shape[-3])
    out = _attention.dot_product_attention(flat(query), flat(key), flat(value), bias, is_causal=is_causal,
                                           key_value_seq_lengths=kv_lengths, **dropout)
    return out.reshape(batch + out.shape[1:])


def _flat_bias(bias, batch, heads, q_len, kv_len):
    """A bias broadcastable to batch + [heads, q_len, kv_len] with its batch dims folded into one
    (kept at 1 when it is broadcast over all of them; expanded over some only)."""
    bias = jnp.asarray(bias)
    full = tuple(batch) + (heads, q_len, kv_len)
    if bias.ndim > len(full):
        raise ValueError(f"bias of shape {bias.shape} is not broadcastable to {full}")
    bias = bias.reshape((1,) * (len(full) - bias.ndim) + bias.shape)
    nb = len(batch)
    if all(d == 1 for d in bias.shape[:nb]):
        return bias.reshape((1,) + bias.shape[nb:])
    bias = jnp.broadcast_to(bias, tuple(batch) + bias.shape[nb:])
    return bias.reshape((math.prod(batch),) + bias.shape[nb:])


def key_prefix_lengths(mask, batch_shape, heads: int, q_len: int, kv_len: int):
    """(L, ok) for a Flax mask broadcastable to batch_shape + [heads, q_len, kv_len].

    L[b] (int32, batch dims flattened) is the number of keys row 0 of head 0 sees; ok is True
    when every row of every head of every batch element sees exactly the keys [0, L[b]) and
    every L[b] >= 1, i.e. when the mask equals key_value_seq_lengths=L.
    """
    m = jnp.broadcast_to(jnp.asarray(mask) != 0, tuple(batch_shape) + (heads, q_len, kv_len))
    m = m.reshape((-1, heads, q_len, kv_len))
    lengths = jnp.sum(m[:, 0, 0, :], axis=-1, dtype=jnp.int32)
    prefix = jnp.arange(kv_len, dtype=jnp.int32) < lengths[:, None, None, None]
    ok = jnp.all(m == prefix) & jnp.all(lengths >= 1)
    return lengths, ok


def _masked_attention(query, key, value, mask, flax_attention, extras, dtype, is_causal):
    """A mask: the kernels with key lengths (and extras: bias, dropout) when the mask is a key
    prefix (decided on the device), flax_attention(q, k, v) otherwise."""
    _check_shapes(query, key, value)
    if key.shape[-2] != query.shape[-2]:  # both branches are traced; Flax's needs equal heads
        raise ValueError(
            f"jax_flash.flax.dot_product_attention: a mask with fewer key/value heads ({key.shape[-2]}) "
            f"than query heads ({query.shape[-2]}) is not supported (Flax's attention, the fallback for "
            "masks that are not a key prefix, needs equal heads); use jax_flash.dot_product_attention, "
            "which takes masks with GQA")
    batch, (q_len, heads), kv_len = query.shape[:-3], query.shape[-3:-1], key.shape[-3]
    kernel_dtype = jnp.asarray(query, dtype).dtype

    def kernels(operands):
        q, k, v, lens = operands
        return _kernel_attention(q, k, v, dtype, is_causal, lens, **extras)

    def flax_branch(operands):
        return flax_attention(*operands[:3]).astype(kernel_dtype)  # the kernels' output dtype

    def kernels_if_key_prefix(q, k, v):
        lengths, ok = key_prefix_lengths(mask, batch, heads, q_len, kv_len)
        return jax.lax.cond(ok, kernels, flax_branch, (q, k, v, lengths))

    if _primitives.gpu_kernels_take(kernel_dtype, query.shape[-1]):
        return kernels_if_key_prefix(query, key, value)
    # The GPU kernels cannot take this dtype / head dim (the kernel branch would fail to compile
    # there): Flax's attention on a GPU, chosen when the computation is lowered for its platform
    # (not by the default backend: a computation placed on the CPU still runs the kernels).
    return jax.lax.platform_dependent(query, key, value, cpu=kernels_if_key_prefix,
                                      default=lambda q, k, v: flax_branch((q, k, v)))


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
