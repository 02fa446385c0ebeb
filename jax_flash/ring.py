"""Ring attention: FlashAttention over a sequence sharded across devices.

Each device holds one block of q rows and one block of k/v rows (the sequence axis is
split over a mesh axis, the "ring"). The kv blocks travel around the ring with
`lax.ppermute`; at every step a device runs the flash kernel of its q block against the kv
block it holds and merges the partial result into its accumulator through the logsumexp
(exact, with -inf guards: the kernels give out 0 / lse -inf for rows with no visible key).
The next block's ppermute is issued before the current block's kernel, so XLA can overlap
the transfer with the compute.

Backward: the same ring, with the GLOBAL out and lse of each q row (so the kernel's
D = rowsum(dO * O) and P = exp(S - lse) are the final ones). dq accumulates locally; the
dk/dv partials of a kv block travel with it and go home with one last ppermute.

Causal and windowed masks: the kernel's q_offset is static, while the relation of the kv
block held at step s to the device's q block depends on the device index. For each step
we enumerate, in Python, the relation for every device (a tuple per q chunk x kv chunk of
"skip", "full" or a diagonal offset), deduplicate, and `lax.switch` among those static
variants. A block that no device needs ends the ring early: a sliding window only visits
the devices in its range (and the kv/dk/dv blocks are not sent further).

Layouts (`layout=`), for n devices on the ring:
  "contiguous": device i holds rows [i*L/n, (i+1)*L/n). Natural for non-causal attention
    and sliding windows (each device only needs its neighbours).
  "zigzag": the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i, so
    every device does the same causal work at every step. The arrays must be in that
    order: `zigzag(x, n)` reorders a natural-order sequence (and `unzigzag` undoes it);
    do it once where the data is made, not per layer.

Collectives: only collective-permutes of kv-sized blocks (k, v forward; k, v, dk, dv
backward, dk/dv in float32).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _validate as V
from ._primitives import MaskSpec, flash_bwd, flash_fwd
from .attention import _spec

try:
    _shard_map = jax.shard_map
    _NO_CHECK = dict(check_vma=False)
except AttributeError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = dict(check_rep=False)

_LAYOUTS = ("contiguous", "zigzag")
def _no_lens():
    # Built inside the traced body (a broadcast, not a captured constant): JAX 0.11 hoists
    # captured constants into shard_map inputs, and Shardy's canonicaliser crashes on an
    # int32[0] input of a manual computation.
    return jnp.zeros((0,), jnp.int32)


# ------------------------------------------------------------------------------ layout


def _chunk_positions(layout, n, dev):
    """Global chunk indices held by device `dev`, in local order."""
    return (dev,) if layout == "contiguous" else (dev, 2 * n - 1 - dev)


def _zigzag_order(n):
    return np.concatenate([[i, 2 * n - 1 - i] for i in range(n)])


def _reorder_chunks(x, n, axis, order):
    L = x.shape[axis]
    if L % (2 * n):
        raise ValueError(f"zigzag: sequence length {L} must be a multiple of 2 * {n}")
    C = L // (2 * n)
    idx = (order[:, None] * C + np.arange(C)[None, :]).reshape(-1)
    x = jnp.asarray(x)
    where = (slice(None),) * (axis % x.ndim) + (jnp.asarray(idx),)
    s = getattr(jax.typeof(x), "sharding", None) if hasattr(jax, "typeof") else None
    if isinstance(s, NamedSharding) and any(e is not None for e in s.spec):
        # Explicit axes: keep x's sharding (a sharded sequence axis costs a collective).
        return x.at[where].get(out_sharding=s)
    return x[where]


def zigzag(x, n, axis=1):
    """Reorder a natural-order sequence axis into the zigzag layout for a ring of n devices:
    chunks (0, 2n-1, 1, 2n-2, ...), so that device i of a contiguous split holds chunks i
    and 2n-1-i. Apply it where the data is made (before sharding the sequence); the
    positions of tokens (e.g. RoPE) must be computed in natural order first."""
    return _reorder_chunks(x, n, axis, _zigzag_order(n))


def unzigzag(x, n, axis=1):
    """Inverse of `zigzag`."""
    return _reorder_chunks(x, n, axis, np.argsort(_zigzag_order(n)))


# --------------------------------------------------------------------- static planning


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis_name: object
    n: int
    layout: str
    spec: MaskSpec


def _classify(spec, off, Tc, Sc):
    """Visibility of a [Tc] q chunk vs a [Sc] kv chunk whose start is `off` keys before the
    q chunk's: "skip" (nothing visible), "full" (no mask) or the offset (diagonal)."""
    lo = -spec.window_right if spec.window_right >= 0 else -math.inf  # lowest i + off - j
    hi = spec.window_left if spec.window_left >= 0 else math.inf
    dmin, dmax = off - (Sc - 1), off + Tc - 1
    if dmax < lo or dmin > hi:
        return "skip"
    if dmin >= lo and dmax <= hi:
        return "full"
    return off


def _plan(cfg, s, dev, Tl, Sl):
    """For device `dev` at ring step s: per q chunk, per kv chunk, the visibility class."""
    n, c = cfg.n, (1 if cfg.layout == "contiguous" else 2)
    src = (dev - s) % n
    Tc, Sc = Tl // c, Sl // c
    return tuple(
        tuple(_classify(cfg.spec, qp * Tc - kp * Sc, Tc, Sc)
              for kp in _chunk_positions(cfg.layout, n, src))
        for qp in _chunk_positions(cfg.layout, n, dev)
    )


def _step_plans(cfg, Tl, Sl):
    """[(step, branch plans, table dev -> branch)] for the steps some device needs."""
    out = []
    for s in range(cfg.n):
        plans = [_plan(cfg, s, d, Tl, Sl) for d in range(cfg.n)]
        if all(cls == "skip" for p in plans for row in p for cls in row):
            continue
        uniq = list(dict.fromkeys(plans))
        out.append((s, uniq, np.array([uniq.index(p) for p in plans], np.int32)))
    return out


def _variant(spec, cls):
    if cls == "full":  # no mask: the cheaper kernel path
        return dataclasses.replace(spec, causal=False, window_left=-1, window_right=-1, q_offset=0)
    return dataclasses.replace(spec, q_offset=int(cls))


def _calls(plan):
    """Kernel calls for a plan: (q chunk ids, kv chunk ids, class). A q chunk that sees all
    kv chunks fully is one call against the whole block; q chunks that all see the same
    single kv chunk fully share a call."""
    nq, nk = len(plan), len(plan[0])
    calls, rest = [], []
    whole = [a for a in range(nq) if all(cls == "full" for cls in plan[a])]
    if whole:
        calls.append((tuple(whole), tuple(range(nk)), "full"))
    for a in range(nq):
        if a in whole:
            continue
        for b in range(nk):
            if plan[a][b] != "skip":
                rest.append((a, b, plan[a][b]))
    fulls = {}
    for a, b, cls in rest:
        if cls == "full":
            fulls.setdefault(b, []).append(a)
        else:
            calls.append(((a,), (b,), cls))
    for b, qs in fulls.items():
        calls.append((tuple(qs), (b,), "full"))
    return calls


def _take(x, ids, c, axis):
    """Concatenation of chunks `ids` (of c) along axis (contiguous ids: one slice)."""
    L = x.shape[axis] // c
    ids = list(ids)
    if ids == list(range(ids[0], ids[-1] + 1)):
        return lax.slice_in_dim(x, ids[0] * L, (ids[-1] + 1) * L, axis=axis)
    return jnp.concatenate([lax.slice_in_dim(x, i * L, (i + 1) * L, axis=axis) for i in ids], axis)


def _put(acc, val, ids, c, axis):
    L = acc.shape[axis] // c
    for j, i in enumerate(ids):
        piece = lax.slice_in_dim(val, j * L, (j + 1) * L, axis=axis)
        acc = lax.dynamic_update_slice_in_dim(acc, piece, i * L, axis=axis)
    return acc


# ------------------------------------------------------------------------------ merging


def _merge(o1, lse1, o2, lse2):
    """Log-add-exp merge of two partial attentions (o float32 [B,T,N,H], lse [B,N,T])."""
    m = jnp.maximum(lse1, lse2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp(lse1 - m_safe), jnp.exp(lse2 - m_safe)  # exp(-inf) = 0
    tot = w1 + w2
    lse = jnp.where(tot > 0, m_safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    inv = jnp.where(tot > 0, 1.0 / jnp.where(tot > 0, tot, 1.0), 0.0)
    t = lambda w: jnp.swapaxes(w * inv, 1, 2)[..., None]  # [B,N,T] -> [B,T,N,1]
    return o1 * t(w1) + o2 * t(w2), lse


# ------------------------------------------------------------------------------ forward


def _fwd_branch(cfg, plan, q, k, v):
    B, Tl, N, H = q.shape
    c = len(plan)
    o = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full((B, N, Tl), -jnp.inf, jnp.float32)
    for qa, kb, cls in _calls(plan):
        qi = _take(q, qa, c, 1)
        oi, li = flash_fwd(qi, _take(k, kb, c, 1), _take(v, kb, c, 1), _no_lens(), _no_lens(),
                           _variant(cfg.spec, cls))
        o_cur, l_cur = _take(o, qa, c, 1), _take(lse, qa, c, 2)
        o_new, l_new = _merge(o_cur, l_cur, oi.astype(jnp.float32), li)
        o, lse = _put(o, o_new, qa, c, 1), _put(lse, l_new, qa, c, 2)
    return o, lse


def _shift(x, cfg, by=1):
    n = cfg.n
    return lax.ppermute(x, cfg.axis_name, [(j, (j + by) % n) for j in range(n)])


def _ring_fwd(cfg, q, k, v):
    dev = lax.axis_index(cfg.axis_name)
    steps = _step_plans(cfg, q.shape[1], k.shape[1])
    last = steps[-1][0] if steps else 0
    by_step = {s: (plans, table) for s, plans, table in steps}
    B, Tl, N, _ = q.shape
    o = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full((B, N, Tl), -jnp.inf, jnp.float32)
    kv = (k, v)
    for s in range(last + 1):
        nxt = _shift(kv, cfg) if s < last else None  # issued first: overlaps the kernel
        if s in by_step:
            plans, table = by_step[s]
            branches = [partial(_fwd_branch, cfg, p) for p in plans]
            if len(branches) == 1:
                o_s, l_s = branches[0](q, *kv)
            else:
                o_s, l_s = lax.switch(jnp.asarray(table)[dev], branches, q, *kv)
            o, lse = _merge(o, lse, o_s, l_s)
        kv = nxt
    return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------- backward


def _bwd_branch(cfg, plan, q, k, v, o, lse, do):
    c = len(plan)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for qa, kb, cls in _calls(plan):
        t = lambda x: _take(x, qa, c, 1)
        kk, vv = _take(k, kb, c, 1), _take(v, kb, c, 1)
        dqi, dki, dvi = flash_bwd(t(q), kk, vv, t(o), _take(lse, qa, c, 2), t(do), _no_lens(),
                                  _no_lens(), _variant(cfg.spec, cls))
        dq = _put(dq, _take(dq, qa, c, 1) + dqi.astype(jnp.float32), qa, c, 1)
        dk = _put(dk, _take(dk, kb, c, 1) + dki.astype(jnp.float32), kb, c, 1)
        dv = _put(dv, _take(dv, kb, c, 1) + dvi.astype(jnp.float32), kb, c, 1)
    return dq, dk, dv


def _ring_bwd(cfg, q, k, v, o, lse, do):
    dev = lax.axis_index(cfg.axis_name)
    steps = _step_plans(cfg, q.shape[1], k.shape[1])
    last = steps[-1][0] if steps else 0
    by_step = {s: (plans, table) for s, plans, table in steps}
    dq = jnp.zeros(q.shape, jnp.float32)
    kv = (k, v)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for s in range(last + 1):
        nxt = _shift(kv, cfg) if s < last else None
        if s in by_step:
            plans, table = by_step[s]
            branches = [partial(_bwd_branch, cfg, p) for p in plans]
            args = (q, *kv, o, lse, do)
            if len(branches) == 1:
                dq_s, dk_s, dv_s = branches[0](*args)
            else:
                dq_s, dk_s, dv_s = lax.switch(jnp.asarray(table)[dev], branches, *args)
            dq = dq + dq_s
            dkv = (dkv[0] + dk_s, dkv[1] + dv_s)
        if s < last:
            dkv = _shift(dkv, cfg)  # the partials travel with their kv block
        kv = nxt
    if last:  # block src now sits on src + last: send its dk/dv home
        dkv = _shift(dkv, cfg, by=-last)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v):
    return _ring_fwd(cfg, q, k, v)


def _ring_vjp_fwd(cfg, q, k, v):
    o, lse = _ring_fwd(cfg, q, k, v)
    return (o, lse), (q, k, v, o, lse)


def _ring_vjp_bwd(cfg, res, cts):
    q, k, v, o, lse = res
    do, _ = cts  # lse is a non-differentiable residual, as in dot_product_attention
    return _ring_bwd(cfg, q, k, v, o, lse, do.astype(q.dtype))


_ring.defvjp(_ring_vjp_fwd, _ring_vjp_bwd)


# ---------------------------------------------------------------------------- public API


def _make_spec(H, scale, causal, window, softcap):
    """The MaskSpec of dot_product_attention's rules (no offset: global positions are top-left)."""
    return _spec(head_dim=H, scale=scale, causal=causal, window=window, softcap=softcap, q_offset=0,
                 deterministic=False, kernel="auto", window_name="window")


def _check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"ring_attention: {name} must be [B, L, heads, H], got shape {x.shape}")
        V.check_dtype(name, x)
    V.check_same_dtype(("q", "k", "v"), (q, k, v))
    B, _, N, H = q.shape
    if k.shape[0] != B or k.shape[3] != H or v.shape != k.shape:
        raise ValueError(f"ring_attention: k/v must be [B={B}, S, K, H={H}], got {k.shape}, {v.shape}")
    if N % k.shape[2]:
        raise ValueError(f"ring_attention: q heads ({N}) must be a multiple of kv heads ({k.shape[2]})")
    V.check_head_dim("q", H)


def ring_attention_shard(q, k, v, *, axis_name, axis_size=None, causal=False, window=None,
                         scale=None, softcap=None, layout="contiguous"):
    """Ring attention on per-device blocks, for use inside `shard_map` (fully manual).

    q [B, Tl, N, H], k/v [B, Sl, K, H]: this device's blocks of a sequence split over
    `axis_name` in `layout` order (see the module docstring). Returns (out [B, Tl, N, H],
    lse float32 [B, N, Tl]); lse is not differentiable. Top-left causal alignment over the
    global positions, as `dot_product_attention(is_causal=True)`; window (left, right) as
    `local_window_size`.
    """
    _check_qkv(q, k, v)
    if layout not in _LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {_LAYOUTS}, got {layout!r}")
    n = axis_size if axis_size is not None else lax.axis_size(axis_name)
    H = q.shape[-1]
    c = 1 if layout == "contiguous" else 2
    for name, L in (("q", q.shape[1]), ("k", k.shape[1])):
        if L % c:
            raise ValueError(f"ring_attention: the zigzag layout needs an even {name} block, got {L}")
    cfg = _Ring(axis_name, int(n), layout, _make_spec(H, scale, causal, window, softcap))
    # Head dims are padded to a multiple of 8 for the GPU kernels (exact, see attention.py).
    pad = -H % 8
    if pad:
        widths = [(0, 0)] * 3 + [(0, pad)]
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    o, lse = _ring(cfg, q, k, v)
    return (o[..., :H] if pad else o), lax.stop_gradient(lse)


def _typed_axes(x, dim):
    s = getattr(jax.typeof(x), "sharding", None) if hasattr(jax, "typeof") else None
    if not isinstance(s, NamedSharding):
        return None
    spec = tuple(s.spec) + (None,) * (4 - len(tuple(s.spec)))
    return spec[dim]


def ring_attention(q, k, v, *, axis_name, mesh=None, causal=False, window=None, scale=None,
                   softcap=None, layout="contiguous", batch_axes=None, head_axes=None,
                   return_lse=False):
    """Attention over a sequence sharded along mesh axis `axis_name`, as a ring.

    q [B, T, N, H], k/v [B, S, K, H] (the layout of `dot_product_attention`), global arrays
    whose sequence axis is (or will be) split over `axis_name` of `mesh` (default: the
    mesh set with `jax.set_mesh`). Works under `jax.jit`, with Auto or Explicit mesh axes,
    and under `jax.grad`. Batch and heads may be sharded too: `batch_axes` / `head_axes`
    (mesh axis names; by default taken from q's sharding type on an Explicit mesh, else
    replicated). kv heads are sharded like q heads, so K must be divisible by their size.

    causal (top-left, like `is_causal`), window=(left, right) (like `local_window_size`),
    scale, softcap: as `dot_product_attention`. layout: "contiguous" or "zigzag" (inputs in
    `jax_flash.zigzag(x, n)` order; balances causal work). Returns out, or (out, lse) with
    lse float32 [B, T, N] (not differentiable) if return_lse.

    Communication: only collective-permutes of kv blocks around the ring (no all-gather);
    blocks a window cannot see are never sent.
    """
    return_lse = V.check_flag("return_lse", return_lse)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check_qkv(q, k, v)
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            raise ValueError("ring_attention: pass mesh=, or set one with jax.set_mesh")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"ring_attention: axis_name {axis_name!r} is not a mesh axis {mesh.axis_names}")
    n = mesh.shape[axis_name]
    if batch_axes is None:
        batch_axes = _typed_axes(q, 0)
    if head_axes is None:
        head_axes = _typed_axes(q, 2)
    h_axes = () if head_axes is None else ((head_axes,) if isinstance(head_axes, str) else tuple(head_axes))
    b_axes = () if batch_axes is None else ((batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
    if axis_name in h_axes or axis_name in b_axes:
        raise ValueError(f"ring_attention: axis {axis_name!r} cannot shard both the sequence and batch/heads")
    d = math.prod(mesh.shape[a] for a in h_axes)
    if q.shape[2] % d or k.shape[2] % d:
        raise ValueError(
            f"ring_attention: head_axes {h_axes} (size {d}) must divide q heads ({q.shape[2]}) "
            f"and kv heads ({k.shape[2]})")
    c = 1 if layout == "contiguous" else 2
    for name, L in (("q", q.shape[1]), ("k", k.shape[1])):
        if L % (n * c):
            raise ValueError(
                f"ring_attention: {name} sequence length {L} must be a multiple of "
                f"{n * c} ({n} devices on {axis_name!r}{', x2 for zigzag' if c == 2 else ''})")
    seq_spec = P(batch_axes, axis_name, head_axes, None)
    lse_spec = P(batch_axes, head_axes, axis_name)

    def local(q, k, v):
        return ring_attention_shard(q, k, v, axis_name=axis_name, axis_size=n, causal=causal,
                                    window=window, scale=scale, softcap=softcap, layout=layout)

    fn = _shard_map(local, mesh=mesh, in_specs=(seq_spec,) * 3, out_specs=(seq_spec, lse_spec),
                    **_NO_CHECK)
    out, lse = fn(q, k, v)
    if return_lse:
        return out, jnp.swapaxes(lse, 1, 2)
    return out
