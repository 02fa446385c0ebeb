"""A plain-JAX reference with jax_flash's semantics, for tests and for checking results.

It materialises the [.., T, S] logits: use it on small problems only."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_mask(T, S, *, causal=False, window=(-1, -1), q_lens=None, kv_lens=None, q_offset=0,
                 bottom_right=False):
    """Boolean [B or 1, T, S] mask of jax_flash's visibility rule (see cuda/common/mask.h)."""
    i = jnp.arange(T)[:, None]
    j = jnp.arange(S)[None, :]
    ql = jnp.full((1,), T) if q_lens is None else jnp.asarray(q_lens)
    kl = jnp.full((1,), S) if kv_lens is None else jnp.asarray(kv_lens)
    ql = jnp.minimum(ql, T)[:, None, None]
    kl = jnp.minimum(kl, S)[:, None, None]
    off = q_offset + (kl - ql if bottom_right else 0)
    d = i[None] + off - j[None]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    vis = (i[None] < ql) & (j[None] < kl)
    if left >= 0:
        vis &= d <= left
    if right >= 0:
        vis &= -d <= right
    return vis


def attention(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=None, q_lens=None,
              kv_lens=None, q_offset=0, bottom_right=False, q_segment_ids=None, kv_segment_ids=None,
              bias=None, mask=None, dropout_keep=None, dropout_rate=0.0, compute_dtype=jnp.float64):
    """q [B, T, N, H], k/v [B, S, K, H] -> (out [B, T, N, H], lse [B, N, T]).

    q_segment_ids [B, T] / kv_segment_ids [B, S]: key j visible to query i only if equal.
    bias (float) and mask (bool, True = attend): broadcastable to [B, N, T, S]; the logits are
    softcap(scale * q.k) + bias. Computed in compute_dtype (float64 needs jax_enable_x64).
    dropout_keep (bool, broadcastable to [B, N, T, S]): the softmax is multiplied by
    keep / (1 - dropout_rate) before it meets v; lse is that of the undropped softmax.
    Rows with no visible key give out 0 and lse -inf."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = 1.0 / (H ** 0.5) if scale is None else scale
    qf = q.astype(compute_dtype)
    kf = jnp.repeat(k.astype(compute_dtype), G, axis=2)
    vf = jnp.repeat(v.astype(compute_dtype), G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", qf, kf) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + jnp.asarray(bias).astype(compute_dtype)
    vis = visible_mask(T, S, causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens,
                       q_offset=q_offset, bottom_right=bottom_right)[:, None]
    if q_segment_ids is not None:
        qs, ks = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
        vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
    if mask is not None:
        vis = vis & jnp.asarray(mask)
    vis = jnp.broadcast_to(vis, s.shape)
    s = jnp.where(vis, s, -jnp.inf)
    # The max shift cancels out of every result, so it carries no gradient. (Differentiating
    # it would go through reduce-max's tie test, which turns into 0/0 under jit when XLA
    # recomputes the logits with different rounding, e.g. a fused multiply-add with the bias.)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m_safe = jnp.where(jnp.isfinite(m), m, 0)
    p = jnp.where(vis, jnp.exp(s - m_safe), 0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1)
    if dropout_keep is not None:
        p = jnp.where(jnp.asarray(dropout_keep), p / jnp.asarray(1 - dropout_rate, compute_dtype), 0)
    out = jnp.einsum("bnts,bsnh->btnh", p, vf)
    lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1)) + m_safe[..., 0], -jnp.inf)
    return out.astype(q.dtype) if compute_dtype == q.dtype else out, lse
