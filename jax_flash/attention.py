"""The public API: `flash_attention` (single-head core) and `dot_product_attention` (a
drop-in for `jax.nn.dot_product_attention`). Both end in `_attention`, a custom_vjp over
the forward and backward primitives on [B, L, N, H] operands."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from . import _validate as V
from ._primitives import KERNELS, MaskSpec, flash_bwd, flash_fwd


class JaxFlashFallbackWarning(UserWarning):
    """An argument the GPU kernels do not take made this call run XLA's attention (Flax's, in
    jax_flash.flax) instead of jax_flash's kernels."""


def _lens_operand(lens):
    # Absent lengths reach the primitives as an int32 [0] operand (the handlers read it as
    # "full"). It is made right before each bind and never crosses a custom_vjp residual or a
    # shard_map boundary: Shardy (JAX 0.11) crashes on zero-size manual-computation inputs.
    return jnp.zeros((0,), jnp.int32) if lens is None else lens


# extras: the optional operands, {name in _primitives.EXTRAS: array or None}; bias/mask are
# [Bb, Nb, Tb, Sb] with each dim 1 or full (see _primitives). Only the bias is differentiable.
@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_lens, kv_lens, extras, spec):
    """q [B,T,N,H], k/v [B,S,K,H]; q_lens/kv_lens int32 [B] or None -> (out, lse [B,N,T])."""
    out, lse = flash_fwd(q, k, v, _lens_operand(q_lens), _lens_operand(kv_lens), spec, extras)
    return out, lse


def _attention_fwd(q, k, v, q_lens, kv_lens, extras, spec):
    out, lse = flash_fwd(q, k, v, _lens_operand(q_lens), _lens_operand(kv_lens), spec, extras)
    return (out, lse), (q, k, v, out, lse, q_lens, kv_lens, extras)


def _attention_bwd(spec, res, cts):
    q, k, v, out, lse, q_lens, kv_lens, extras = res
    dout, _ = cts  # lse is returned as a non-differentiable residual (see docs)
    dq, dk, dv, *dbias = flash_bwd(q, k, v, out, lse, dout.astype(q.dtype), _lens_operand(q_lens),
                                   _lens_operand(kv_lens), spec, extras)
    # Integer segment ids and the boolean mask take no cotangent (None).
    d_extras = {name: None for name in extras}
    if dbias:
        d_extras["bias"] = dbias[0].astype(extras["bias"].dtype)
    return dq, dk, dv, None, None, d_extras


_attention.defvjp(_attention_fwd, _attention_bwd)


# The GPU kernels load rows in 16-byte vectors, so they take head dims that are multiples
# of 8. Other head dims are zero-padded here (exact: zero columns add nothing to q.k and
# produce zero output columns, which are sliced off; autodiff slices the gradients).
_HEAD_DIM_MULTIPLE = 8


def _call(q, k, v, q_lens, kv_lens, spec, extras=None):
    H = q.shape[-1]
    pad = -H % _HEAD_DIM_MULTIPLE
    if pad:
        widths = [(0, 0)] * (q.ndim - 1) + [(0, pad)]
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    extras = {n: x for n, x in (extras or {}).items() if x is not None}
    out, lse = _attention(q, k, v, q_lens, kv_lens, extras, spec)
    return (out[..., :H] if pad else out), lse


def _spec(*, head_dim, scale, causal, window, softcap, q_offset, deterministic, kernel, window_name,
          dropout_rate=0.0, causal_name="causal"):
    causal = V.check_flag(causal_name, causal)
    deterministic = V.check_flag("deterministic", deterministic)
    V.check_scale(scale)
    softcap = V.check_softcap(softcap)
    left, right = V.normalize_window(window_name, window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    offset, bottom_right = V.check_q_offset(q_offset)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    return MaskSpec(
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        softcap=softcap,
        window_left=left,
        window_right=right,
        causal=causal,
        q_offset=offset,
        bottom_right=bottom_right,
        deterministic=deterministic,
        kernel=kernel,
        dropout_rate=dropout_rate,
    )


def _dropout_keys(rng, B, N, broadcast=False):
    """The kernels' dropout operand, uint32 [B, N, 4]: per (batch, head) the 64-bit Philox key
    jax.random.bits(rng, (2,), uint32) and the counter coordinates (b, n), or (0, 0) for every
    (b, n) when broadcast (one mask shared by the batch and heads). Made from the traced key
    inside the computation, so jit, vmap (a vmapped key maps this table) and grad see an operand."""
    seed = jax.random.bits(rng, (2,), jnp.uint32)
    b = jnp.arange(B, dtype=jnp.uint32)[:, None]
    n = jnp.arange(N, dtype=jnp.uint32)[None, :]
    if broadcast:
        b, n = 0 * b, 0 * n
    cols = (seed[0], seed[1], b, n)
    return jnp.stack([jnp.broadcast_to(c, (B, N)) for c in cols], axis=-1)


def flash_attention(
    q,
    k,
    v,
    *,
    scale=None,
    causal: bool = False,
    window=None,
    softcap=None,
    q_lengths=None,
    kv_lengths=None,
    q_offset=0,
    return_lse: bool = False,
    deterministic: bool = False,
    kernel: str = "auto",
    q_segment_ids=None,
    kv_segment_ids=None,
    bias=None,
    mask=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
):
    """Single-head FlashAttention: softmax(scale * q k^T) v without an S x T matrix.

    Args:
      q: [..., T, H] queries (bfloat16, float16 or float32; float32 runs on the CPU only).
      k, v: [..., S, H] keys and values, the same leading dims and dtype as q.
      scale: logit scale (default 1/sqrt(H)).
      causal: key j is visible to query i only if j <= i + offset (see q_offset).
      window: int or (left, right): key j visible iff -right <= (i + offset) - j <= left;
        None on a side = unbounded. Composes with causal (right becomes 0).
      softcap: if set, logits -> softcap * tanh(logits / softcap) before masking.
      q_lengths, kv_lengths: integer arrays of shape q.shape[:-2]: rows at or past the
        length are padding (query padding rows give output 0).
      q_offset: int, the key position of query row 0 (default 0: top-left alignment, as
        jax.nn), or "bottom_right": offset = kv_length - q_length per sequence (the last
        query sits at the last key: KV-cache decoding and chunked prefill).
      q_segment_ids, kv_segment_ids: integer arrays of shape q.shape[:-2] + (T,) and
        k.shape[:-2] + (S,), given together (packed sequences): key j is visible to query i
        only if their ids are equal, on top of every other rule.
      bias: float array broadcastable to q.shape[:-2] + (T, S), added to the logits after
        scale and softcap, before masking (differentiable).
      mask: bool array broadcastable to q.shape[:-2] + (T, S); True = may attend.
        bias and mask are read tile by tile through broadcast strides, never expanded,
        except a bias/mask broadcast over some leading dims but not all (expanded over them).
        On a GPU, calls with segment ids, bias or mask run the portable (sm80) kernels, or on
        Hopper the Hopper kernels where they take them (see jax_flash.dot_product_attention;
        kernel="hopper" is an error). Their dbias over a broadcast axis is summed with float
        atomics, so deterministic=True with such a bias is an error on the GPU.
      dropout_rate: attention dropout (a static Python float in [0, 1)): each element of the
        softmax is dropped with this probability and kept ones are scaled by 1 / (1 - rate);
        lse stays that of the undropped softmax. 0 (default) is exactly no dropout. On a GPU it
        drops exactly the elements the CPU backend drops for the same key; on Hopper the
        Hopper kernels run it when it comes without segment ids, bias or mask (the backward
        also without softcap or deterministic=True), else the portable kernels
        (kernel="hopper" is an error).
      dropout_rng: a JAX PRNG key (jax.random.key, or a raw jax.random.PRNGKey), required when
        dropout_rate > 0. The mask is a pure function of the key and the element's
        coordinates (the flattened leading index, 0, query row, key column; see
        cuda/common/philox.h): the same key gives the same mask; vmap over keys gives each
        example its own.
      return_lse: also return the float32 logsumexp [..., T] (natural log; -inf on rows
        with no visible key). It is not differentiable (like jax.nn's residual).
      deterministic: GPU backward with the same bits run to run (dQ partial sums are added
        in a fixed order; about 30-40% slower on Hopper). The CPU backend always is. Not
        available on the GPU with a bias broadcast over some axis (see bias). Without it the
        GPU's dQ, and on Hopper at head dims 193-256 the dK / dV of a non-causal launch's
        last round of key blocks (summed from pieces by float atomics, NOTES.md v82b / v84),
        may differ in the last bits.
      kernel: "auto", "portable" (sm80 path) or "hopper" (sm90 path); ignored on CPU. The
        Hopper kernels take head dims that are multiples of 8 up to 256, zero-padded to 64,
        128 or 256 (the backward of head dims 129-192 runs the portable kernel); other head
        dims run the portable kernels even under kernel="hopper".

    A row with no visible key returns 0 (lse -inf) and gets zero gradients.
    vmap over any axis of any subset of q/k/v folds into the kernel's batch or head
    dimension; vmapping q alone shares k/v without broadcasting them (GQA-style).

    On a GPU, segment ids, bias, mask and dropout run in the portable kernels, or on Hopper
    in the Hopper kernels where they take them (see jax_flash.dot_product_attention).
    """
    return_lse = V.check_flag("return_lse", return_lse)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have rank >= 2 ([..., L, H]), got shape {x.shape}")
        V.check_dtype(name, x)
    V.check_same_dtype(("q", "k", "v"), (q, k, v))
    lead = q.shape[:-2]
    if k.shape[:-2] != lead or v.shape[:-2] != lead:
        raise ValueError(
            f"q, k, v must share leading dims, got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    T, H = q.shape[-2:]
    S = k.shape[-2]
    if k.shape[-1] != H:
        raise ValueError(f"k head dim must equal q's ({H}), got k shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {k.shape}, got {v.shape}")
    V.check_head_dim("q", H)
    V.check_nonempty("q", "length T", T)
    V.check_nonempty("k", "length S", S)
    dropout_rate, dropout_rng = V.check_dropout(dropout_rate, dropout_rng)
    spec = _spec(
        head_dim=H, scale=scale, causal=causal, window=window, softcap=softcap, q_offset=q_offset,
        deterministic=deterministic, kernel=kernel, window_name="window", dropout_rate=dropout_rate,
    )
    B = math.prod(lead)
    lens = []
    for name, x in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        if x is not None:
            x = jnp.asarray(x)
            if x.shape != lead:
                raise ValueError(f"{name} must have shape {lead} (q's leading dims), got {x.shape}")
            x = V.check_lengths(name, x.reshape(-1), B)
        lens.append(x)
    q_seg, kv_seg = V.check_segment_ids(("q_segment_ids", "kv_segment_ids"), (q_segment_ids, kv_segment_ids),
                                        (lead + (T,), lead + (S,)))
    extras = {}
    if q_seg is not None:
        extras.update(q_segment_ids=q_seg.reshape(B, T), kv_segment_ids=kv_seg.reshape(B, S))
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            extras[name] = _core_bnts(name, x, lead, T, S, B)
    if dropout_rate:
        extras["dropout"] = _dropout_keys(dropout_rng, B, 1)
    out, lse = _call(
        q.reshape(B, T, 1, H), k.reshape(B, S, 1, H), v.reshape(B, S, 1, H), lens[0], lens[1], spec, extras
    )
    out = out.reshape(q.shape)
    if return_lse:
        return out, jax.lax.stop_gradient(lse.reshape(lead + (T,)))
    return out


def _core_bnts(name, x, lead, T, S, B):
    """The core's bias/mask (broadcastable to lead + (T, S)) as [Bb, 1, Tb, Sb], Bb in {1, B}."""
    x = V.check_broadcastable(name, x, lead + (T, S), "q.shape[:-2] + (T, S)")
    if any(d != 1 for d in x.shape[:-2]) and x.shape[:-2] != lead:
        # Broadcast over some leading dims only: one batch stride cannot say that, so expand.
        x = jnp.broadcast_to(x, lead + x.shape[-2:])
    bb = 1 if all(d == 1 for d in x.shape[:-2]) else B
    return x.reshape(bb, 1, *x.shape[-2:])


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    softcap=None,
    return_residual: bool = False,
    implementation=None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    broadcast_dropout: bool = False,
):
    """A drop-in for `jax.nn.dot_product_attention` backed by FlashAttention kernels.

    Same arguments, layouts ([B, T, N, H] or [T, N, H]; key/value [B, S, K, H] with
    N % K == 0), defaults and semantics (causal is top-left aligned; local_window_size
    (left, right) as jax.nn; `bias` added to the scaled logits and `mask` (bool, True =
    attend) applied with every other rule, both broadcastable to [B, N, T, S] as in jax.nn),
    plus `softcap` and packed sequences. With `return_residual=True` returns (out, lse) with
    lse float32 [B, T, N] (natural log).

    softcap: logits -> softcap * tanh(logits / softcap), applied before the bias is added
      (so an additive mask or position bias is not squashed by the cap).
    query_segment_ids, key_value_segment_ids: integer [B, T] and [B, S] ([T], [S] unbatched),
      given together: key j is visible to query i only if their ids are equal.
    dropout_rate, dropout_rng: attention dropout, named as in Flax. dropout_rate is a static
      Python float in [0, 1) (0, the default, is exactly no dropout); dropout_rng a JAX PRNG key
      (jax.random.key or a raw jax.random.PRNGKey), required when the rate is > 0. Each softmax
      element (b, n, t, s) is dropped with probability dropout_rate (kept ones scaled by
      1 / (1 - rate)) by a counter-based RNG (Philox4x32-10, cuda/common/philox.h) keyed by
      jax.random.bits(dropout_rng, (2,), uint32): the same key gives the same mask, and it is
      recomputed, never stored, in the backward. The lse residual is of the undropped softmax.
      Under vmap a mapped key gives each example its own mask; an unmapped key gives every
      example the mask of the unbatched call (as a loop with that key would). The CPU and GPU
      kernels drop exactly the same elements for the same key.
    broadcast_dropout: False (default): an independent mask per batch element and head. True:
      one [T, S] mask shared by every batch element and head, as Flax's broadcast_dropout
      (whose default is True).

    Differences from jax.nn's XLA path, by design: a query row that sees no key (e.g. a
    key_value_seq_length of 0, or a fully masked row) gives output 0 and lse -inf where XLA
    averages V; lse is float32 rather than the input dtype.

    Where it runs: bias, mask, segment ids and dropout run in jax_flash's kernels on both
    platforms: the CPU kernels, and on a GPU the portable (sm80) kernels, except that on
    Hopper the Hopper forward runs segment ids, bias and mask in any mix (not a bias at head
    dims <= 64 read element-wise, which is faster on the portable forward) and dropout alone,
    and the Hopper backward runs one of segment ids, bias / mask or dropout without softcap
    or deterministic=True (the other mixes: the portable kernels);
    implementation="hopper" with any of them is an error. The bias
    is read through its broadcast strides (never expanded); its gradient over broadcast axes is
    summed with float atomics on the GPU.

    implementation: None or "jax_flash" (auto kernel choice), "portable" / "hopper"
    (force a GPU kernel family), or "xla" / "cudnn" to call jax.nn's own implementations
    (segment ids are turned into a mask for them; they have no dropout).
    """
    seg_names = ("query_segment_ids", "key_value_segment_ids")
    is_causal = V.check_flag("is_causal", is_causal)
    return_residual = V.check_flag("return_residual", return_residual)
    broadcast_dropout = V.check_flag("broadcast_dropout", broadcast_dropout)
    dropout_rate, dropout_rng = V.check_dropout(dropout_rate, dropout_rng)
    if implementation in ("xla", "cudnn"):
        if dropout_rate:
            raise ValueError(f"dropout_rate > 0 is not supported by implementation={implementation!r} "
                             "(jax.nn's attention has no dropout); use implementation=None")
        if softcap is not None:
            raise ValueError(f"softcap is not supported by implementation={implementation!r}")
        query = jnp.asarray(query)
        lead = query.shape[:-3]
        q_seg, kv_seg = V.check_segment_ids(seg_names, (query_segment_ids, key_value_segment_ids),
                                            (lead + query.shape[-3:-2], lead + jnp.shape(key)[-3:-2]))
        return jax.nn.dot_product_attention(
            query, key, value, bias, _segment_mask(mask, q_seg, kv_seg), scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual,
        )
    kernels = {None: "auto", "jax_flash": "auto", "portable": "portable", "hopper": "hopper"}
    if implementation not in kernels:
        raise ValueError(
            "implementation must be None, 'jax_flash', 'portable', 'hopper', 'xla' or 'cudnn', "
            f"got {implementation!r}"
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if query.ndim not in (3, 4):
        raise ValueError(f"query must be [B, T, N, H] or [T, N, H], got shape {query.shape}")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(f"{name} must have query's rank {query.ndim}, got shape {x.shape}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        V.check_dtype(name, x)
    V.check_same_dtype(("query", "key", "value"), (query, key, value))
    unbatched = query.ndim == 3
    q_seg, kv_seg = V.check_segment_ids(
        seg_names, (query_segment_ids, key_value_segment_ids),
        (query.shape[:-3] + query.shape[-3:-2], key.shape[:-3] + key.shape[-3:-2]))
    if unbatched:
        query, key, value = query[None], key[None], value[None]
        q_seg, kv_seg = (None, None) if q_seg is None else (q_seg[None], kv_seg[None])
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    if key.shape[0] != B or key.shape[3] != H:
        raise ValueError(f"key must be [B={B}, S, K, H={H}], got {key.shape}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {key.shape}, got {value.shape}")
    V.check_nonempty("query", "heads N", N)
    V.check_nonempty("key", "heads K", K)
    if N % K != 0:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({K})")
    V.check_head_dim("query", H)
    V.check_nonempty("query", "sequence length T", T)
    V.check_nonempty("key", "sequence length S", S)
    q_lens = V.check_lengths("query_seq_lengths", query_seq_lengths, B)
    kv_lens = V.check_lengths("key_value_seq_lengths", key_value_seq_lengths, B)
    spec = _spec(
        head_dim=H, scale=scale, causal=is_causal, window=local_window_size, softcap=softcap,
        q_offset=0, deterministic=False, kernel=kernels[implementation],
        window_name="local_window_size", dropout_rate=dropout_rate, causal_name="is_causal",
    )
    full = (B, N, T, S)
    extras = {
        "q_segment_ids": q_seg, "kv_segment_ids": kv_seg,
        "bias": None if bias is None else V.check_broadcastable("bias", bias, full, "[B, N, T, S]"),
        "mask": None if mask is None else V.check_broadcastable("mask", mask, full, "[B, N, T, S]"),
        "dropout": _dropout_keys(dropout_rng, B, N, broadcast_dropout) if dropout_rate else None,
    }
    out, lse = _call(query, key, value, q_lens, kv_lens, spec, extras)
    lse = jnp.swapaxes(lse, -1, -2)  # [B, N, T] -> [B, T, N]
    if unbatched:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jax.lax.stop_gradient(lse)
    return out


def _segment_mask(mask, q_seg, kv_seg):
    """mask AND (q_seg == kv_seg) as a jax.nn mask ([..., 1, T, S]), for XLA's attention."""
    if q_seg is None:
        return mask
    same = q_seg[..., None, :, None] == kv_seg[..., None, None, :]
    return same if mask is None else jnp.logical_and(mask, same)
