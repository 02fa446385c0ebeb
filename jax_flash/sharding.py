"""Multi-device partitioning of the forward and backward primitives.

What is partitioned, and how:

* Batch (B) and heads (N for q, K for k/v) shard freely: each device runs the kernel on
  its own batch rows and heads, with no collective. For GQA the q heads are the compound
  factor (k g) (kv head major, group minor), so sharding q heads over axes whose size
  divides K shards k/v heads the same way; when it does not (e.g. MQA, or more head
  shards than kv heads), k/v stay replicated over those axes and each shard slices the
  one kv head its q heads read (`axis_index`, no communication).
* The sequence axes (T, S) and the head dim (H) are never split by the partitioner. A
  sequence-sharded attention needs a ring (`jax_flash.ring_attention`): it is an explicit
  API rather than a hidden all-gather. Under an Auto mesh the sharding rule marks T, S and
  H as need-replication, so XLA replicates them if a caller shards them; under an Explicit
  mesh ("sharding in types") the abstract evaluation raises a ValueError naming the
  offending axis instead.

Mechanics: the primitives' lowering (see _primitives.py) calls `partitioned_fwd` /
`partitioned_bwd`, `custom_partitioning` functions whose body binds the local primitives
(straight to the FFI call). They carry a Shardy `sharding_rule` (JAX's default
partitioner) and the GSPMD callbacks (`infer_sharding_from_operands`,
`propagate_user_sharding`) for `jax_use_shardy_partitioner=False`. The `partition`
callback picks the shardings the kernel can honour (batch and heads kept, everything else
replicated) and returns the per-shard body.
"""

from __future__ import annotations

import itertools
import math

import jax
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ._primitives import flash_bwd_local_p, flash_fwd_local_p

try:  # the type of mesh axes (jax >= 0.5); Explicit axes are "sharding in types"
    from jax.sharding import AxisType as _AxisType
except ImportError:  # pragma: no cover
    _AxisType = None


# ------------------------------------------------------------------------ spec helpers


def _axes(entry) -> tuple:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _entry(axes: tuple):
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def _spec_axes(spec, ndim) -> list:
    spec = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return [_axes(e) for e in spec]


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _head_plan(mesh, n_axes, N, K):
    """How kv heads are sharded given q's head axes: ("same", axes) when K splits like N,
    ("slice", ()) when each shard's q heads read a single kv head that the shard slices out
    of replicated k/v, or ("none", ()) when heads must be replicated."""
    if not n_axes:
        return "same", ()
    d = _size(mesh, n_axes)
    if N % d:
        return "none", ()
    if K % d == 0:
        return "same", n_axes
    if d % K == 0:
        return "slice", ()
    return "none", ()


# ------------------------------------------- output shardings for Explicit mesh axes


def _explicit(mesh, axes) -> tuple:
    """The Explicit-typed axes among `axes` (Auto and Manual axes are not in the type)."""
    if _AxisType is None:
        return ()
    types = getattr(mesh, "_name_to_type", {})
    return tuple(a for a in axes if types.get(a) == _AxisType.Explicit)


def _typed_specs(q, k, v):
    """(mesh, q axes, k axes) from the avals' shardings, or None when avals carry none."""
    s = getattr(q, "sharding", None)
    if not isinstance(s, NamedSharding):
        return None
    specs = []
    for x in (q, k, v):
        xs = getattr(x, "sharding", None)
        specs.append(_spec_axes(xs.spec, 4) if isinstance(xs, NamedSharding) else [()] * 4)
    return s.mesh, specs


def _check_explicit(mesh, q_ax, k_ax, v_ax, N, K):
    """Errors for Explicit shardings the kernels cannot honour (clear, at trace time)."""
    ex = lambda axes: _explicit(mesh, axes)
    for name, axes, dim in (("query", q_ax, 1), ("key", k_ax, 1), ("value", v_ax, 1)):
        if ex(axes[dim]):
            raise ValueError(
                f"jax_flash: the {name} sequence axis is sharded over mesh axes {ex(axes[dim])}; "
                "jax_flash does not all-gather sequences behind your back. Use "
                "jax_flash.ring_attention(q, k, v, mesh=..., axis_name=...) for sequence "
                "(context) parallelism, or reshard the sequence axis to replicated "
                "(jax.sharding.reshard) first.")
        if ex(axes[3]):
            raise ValueError(
                f"jax_flash: the {name} head-dim axis (last) is sharded over mesh axes "
                f"{ex(axes[3])}; the kernels need whole head vectors. Shard batch or heads "
                "instead, or reshard the head dim to replicated.")
    if ex(k_ax[0]) != ex(q_ax[0]) or ex(v_ax[0]) != ex(q_ax[0]):
        raise ValueError(
            f"jax_flash: query, key and value must share the batch sharding; got query "
            f"{ex(q_ax[0])}, key {ex(k_ax[0])}, value {ex(v_ax[0])}")
    if ex(v_ax[2]) != ex(k_ax[2]):
        raise ValueError(
            f"jax_flash: key and value must share the head sharding; got key {ex(k_ax[2])}, "
            f"value {ex(v_ax[2])}")
    mode, kv_axes = _head_plan(mesh, ex(q_ax[2]), N, K)
    ok = (mode == "same" and ex(k_ax[2]) == kv_axes) or (mode == "slice" and not ex(k_ax[2]))
    if not ok:
        want = (f"key/value heads sharded over {kv_axes}" if mode == "same" else
                "key/value heads replicated" if mode == "slice" else
                f"a head sharding that divides query heads ({N}) and key/value heads ({K})")
        raise ValueError(
            f"jax_flash: query heads ({N}) are sharded over {ex(q_ax[2])} and key/value heads "
            f"({K}) over {ex(k_ax[2])}; q head n reads kv head n // {N // max(K, 1)}, so this "
            f"needs {want}.")


def fwd_out_shardings(q, k, v, q_lens, kv_lens):
    """`sharding=` kwargs for the forward's abstract outputs (o like q, lse [B, N, T]).

    Empty where avals carry no sharding (older JAX). Only Explicit axes are in the type;
    Auto-axis decisions are left to the partitioner."""
    typed = _typed_specs(q, k, v)
    if typed is None:
        return {}, {}
    mesh, (q_ax, k_ax, v_ax) = typed
    _check_explicit(mesh, q_ax, k_ax, v_ax, q.shape[2], k.shape[2])
    b, n = _entry(q_ax[0]), _entry(q_ax[2])
    return (dict(sharding=NamedSharding(mesh, P(b, None, n, None))),
            dict(sharding=NamedSharding(mesh, P(b, n, None))))


def bwd_out_shardings(q, k, v, o, lse, do, q_lens, kv_lens):
    """`sharding=` kwargs for dq (like q) and dk/dv (like k)."""
    typed = _typed_specs(q, k, v)
    if typed is None:
        return {}, {}
    mesh, (q_ax, k_ax, v_ax) = typed
    _check_explicit(mesh, q_ax, k_ax, v_ax, q.shape[2], k.shape[2])
    b = _entry(q_ax[0])
    return (dict(sharding=NamedSharding(mesh, P(b, None, _entry(q_ax[2]), None))),
            dict(sharding=NamedSharding(mesh, P(b, None, _entry(k_ax[2]), None))))


# ------------------------------------------------------------ custom_partitioning rules


def _plan(mesh, arg_shapes):
    """Batch axes, q head axes, kv head axes and the head mode for the operands' shardings
    as the partitioner proposes them. Only batch and heads survive."""
    q, k = arg_shapes[0], arg_shapes[1]
    N, K = q.shape[2], k.shape[2]
    s = q.sharding
    if not isinstance(s, NamedSharding):  # no mesh to decode against: run replicated
        return (), (), (), "none"
    q_ax = _spec_axes(s.spec, 4)
    b_axes = q_ax[0] if q.shape[0] % max(_size(mesh, q_ax[0]), 1) == 0 else ()
    mode, kv_axes = _head_plan(mesh, q_ax[2], N, K)
    n_axes = q_ax[2] if mode != "none" else ()
    return b_axes, n_axes, kv_axes, mode


def _shardings(mesh, b_axes, n_axes, kv_axes, lens_shapes):
    ns = lambda *e: NamedSharding(mesh, P(*e))
    b = _entry(b_axes)
    q_s = ns(b, None, _entry(n_axes), None)
    kv_s = ns(b, None, _entry(kv_axes), None)
    lse_s = ns(b, _entry(n_axes), None)
    lens_s = [ns(b if x.shape[0] else None) for x in lens_shapes]
    return q_s, kv_s, lse_s, lens_s


def _slice_kv(mesh, n_axes, N_local, G, *kvs):
    """For the "slice" head mode: the kv head this shard's q heads read."""
    idx = 0
    for a in n_axes:  # row-major linear index over the head axes, as in the sharding
        idx = idx * mesh.shape[a] + lax.axis_index(a)
    head = (idx * N_local) // G
    return [lax.dynamic_slice_in_dim(x, head, 1, axis=2) for x in kvs]


def _fwd_body(spec, q, k, v, q_lens, kv_lens, *extras):
    return tuple(flash_fwd_local_p.bind(q, k, v, q_lens, kv_lens, *extras, spec=spec))


def _bwd_body(spec, q, k, v, o, lse, do, q_lens, kv_lens, *extras):
    return tuple(flash_bwd_local_p.bind(q, k, v, o, lse, do, q_lens, kv_lens, *extras, spec=spec))


# The optional operands (spec.extras): segment ids [B, L] shard with the batch; the dropout
# table [B, N, 4] like lse's [B, N]; a bias/mask
# [Bb, Nb, Tb, Sb] shards its batch and head dims like q where they are not broadcast (size 1
# against a larger B or N), and is replicated on the rest. dbias is summed over the mesh axes
# that shard batch or heads where the bias is broadcast.


def _extras_shardings(spec, mesh, extras_shapes, q_shape, b_axes, n_axes):
    ns = lambda *e: NamedSharding(mesh, P(*e))
    out = []
    for name, x in zip(spec.extras, extras_shapes):
        if name in ("q_segment_ids", "kv_segment_ids"):
            out.append(ns(_entry(b_axes), None))
        elif name == "dropout":
            out.append(ns(_entry(b_axes), _entry(n_axes), None))
        else:
            b = _entry(b_axes) if x.shape[0] == q_shape[0] else None
            n = _entry(n_axes) if x.shape[1] == q_shape[2] else None
            out.append(ns(b, n, None, None))
    return out


def _dbias_psum_axes(spec, extras_shapes, q_shape, b_axes, n_axes):
    bias = dict(zip(spec.extras, extras_shapes))["bias"]
    return ((b_axes if bias.shape[0] != q_shape[0] else ()) +
            (n_axes if bias.shape[1] != q_shape[2] else ()))


def _fwd_partition(spec, mesh, arg_shapes, result_shape):
    b_axes, n_axes, kv_axes, mode = _plan(mesh, arg_shapes)
    q_s, kv_s, lse_s, lens_s = _shardings(mesh, b_axes, n_axes, kv_axes, arg_shapes[3:5])
    ex_s = _extras_shardings(spec, mesh, arg_shapes[5:], arg_shapes[0].shape, b_axes, n_axes)
    N, K = arg_shapes[0].shape[2], arg_shapes[1].shape[2]

    def lower(q, k, v, q_lens, kv_lens, *extras):
        if mode == "slice":
            k, v = _slice_kv(mesh, n_axes, q.shape[2], N // K, k, v)
        return _fwd_body(spec, q, k, v, q_lens, kv_lens, *extras)

    return mesh, lower, (q_s, lse_s), (q_s, kv_s, kv_s, *lens_s, *ex_s)


def _bwd_partition(spec, mesh, arg_shapes, result_shape):
    b_axes, n_axes, kv_axes, mode = _plan(mesh, arg_shapes)
    q_s, kv_s, lse_s, lens_s = _shardings(mesh, b_axes, n_axes, kv_axes, arg_shapes[6:8])
    ex_shapes = arg_shapes[8:]
    ex_s = _extras_shardings(spec, mesh, ex_shapes, arg_shapes[0].shape, b_axes, n_axes)
    dbias_s = [ex_s[spec.extras.index("bias")]] if "bias" in spec.extras else []
    psum_axes = _dbias_psum_axes(spec, ex_shapes, arg_shapes[0].shape, b_axes, n_axes) if dbias_s else ()
    N, K = arg_shapes[0].shape[2], arg_shapes[1].shape[2]

    def reduce_dbias(outs):
        if psum_axes:
            outs = (*outs[:3], lax.psum(outs[3], psum_axes))
        return outs

    def lower(q, k, v, o, lse, do, q_lens, kv_lens, *extras):
        if mode != "slice":
            return reduce_dbias(_bwd_body(spec, q, k, v, o, lse, do, q_lens, kv_lens, *extras))
        # Each shard's dk/dv is a partial for one kv head of replicated k/v: place it and
        # sum over the head axes (the one collective this uncommon layout needs).
        G = N // K
        ks, vs = _slice_kv(mesh, n_axes, q.shape[2], G, k, v)
        dq, dk1, dv1, *dbias = reduce_dbias(_bwd_body(spec, q, ks, vs, o, lse, do, q_lens, kv_lens, *extras))
        idx = 0
        for a in n_axes:
            idx = idx * mesh.shape[a] + lax.axis_index(a)
        head = (idx * q.shape[2]) // G
        # d1 [b, S, 1, H] scattered to kv head `head` of [b, S, K, H] by a one-hot product
        # (a dynamic_update_slice into fresh zeros trips JAX 0.11's sharding-type check).
        def place(d1, like):
            onehot = lax.broadcasted_iota(jax.numpy.int32, (1, 1, like.shape[2], 1), 2) == head
            return d1 * onehot.astype(d1.dtype)
        dk = lax.psum(place(dk1, k), n_axes)
        dv = lax.psum(place(dv1, v), n_axes)
        return (dq, dk, dv, *dbias)

    return (mesh, lower, (q_s, kv_s, kv_s, *dbias_s),
            (q_s, kv_s, kv_s, q_s, lse_s, q_s, *lens_s, *ex_s))


def _fwd_infer(spec, mesh, arg_shapes, result_shape):
    b_axes, n_axes, kv_axes, _ = _plan(mesh, arg_shapes)
    q_s, _, lse_s, _ = _shardings(mesh, b_axes, n_axes, kv_axes, arg_shapes[3:5])
    return (q_s, lse_s)


def _bwd_infer(spec, mesh, arg_shapes, result_shape):
    b_axes, n_axes, kv_axes, _ = _plan(mesh, arg_shapes)
    q_s, kv_s, _, _ = _shardings(mesh, b_axes, n_axes, kv_axes, arg_shapes[6:8])
    ex_s = _extras_shardings(spec, mesh, arg_shapes[8:], arg_shapes[0].shape, b_axes, n_axes)
    dbias_s = [ex_s[spec.extras.index("bias")]] if "bias" in spec.extras else []
    return (q_s, kv_s, kv_s, *dbias_s)


def _dims(t):
    from jax._src.lib.mlir import ir  # the rule callback receives MLIR types

    return tuple(ir.RankedTensorType(t).shape)


def _lens_factor(shape, name):
    # Lengths are [B] (factor b) or absent, int32 [0] (a factor of its own, never split).
    return ("b", ()) if shape[0] else (name, (name,))


def _qheads(mesh, N, K):
    """The q-heads factor. (k g) ties q heads to kv heads, so sharding either propagates
    to the other; but if some mesh axes could split N and not K, Shardy would shard kv
    heads over a sub-axis, which custom_partitioning cannot decode to a NamedSharding. The
    q heads are then a factor n of their own and `_fwd_partition` picks the kv sharding."""
    G = N // K
    if G == 1:
        return "k", {}
    sizes = list(mesh.shape.values()) if mesh is not None and not mesh.empty else []
    for r in range(1, len(sizes) + 1):
        for combo in itertools.combinations(sizes, r):
            d = math.prod(combo)
            if N % d == 0 and K % d:
                return "n", {}
    return "(k g)", {"g": G}


def _extras_terms(spec, q, S, extras, n):
    """Rule terms of the optional operands, and the factors of their own that they add: a
    broadcast dim (size 1 against a longer one) gets a fresh factor, replicated."""
    terms, own = [], []
    for i, (name, x) in enumerate(zip(spec.extras, extras)):
        if name in ("q_segment_ids", "kv_segment_ids"):
            terms.append("b t" if name == "q_segment_ids" else "b s")
            continue
        if name == "dropout":  # [B, N, 4]: the 4 key/coordinate words stay whole
            own.append(f"z{i}")
            terms.append(f"b {n} z{i}")
            continue
        dims = []
        for a, (full, f) in enumerate(zip((q[0], q[2], q[1], S), ("b", n, "t", "s"))):
            if x[a] != full:
                f = f"z{i}_{a}"
                own.append(f)
            dims.append(f)
        terms.append(" ".join(dims))
    return terms, own


def _fwd_rule(spec, mesh, operand_types, result_types):
    q, k, _, ql, kvl, *ex = (_dims(t) for t in operand_types)
    n, sizes = _qheads(mesh, q[2], k[2])
    (lq, rq), (lk, rk) = _lens_factor(ql, "x"), _lens_factor(kvl, "y")
    terms, own = _extras_terms(spec, q, k[1], ex, n)
    extra = "".join(f", {t}" for t in terms)
    rule = f"b t {n} h, b s k h, b s k h, {lq}, {lk}{extra} -> b t {n} h, b {n} t"
    return rule, dict(need_replication_factors=("t", "h", "s", *rq, *rk, *own), **sizes)


def _bwd_rule(spec, mesh, operand_types, result_types):
    q, k, _, _, _, _, ql, kvl, *ex = (_dims(t) for t in operand_types)
    n, sizes = _qheads(mesh, q[2], k[2])
    (lq, rq), (lk, rk) = _lens_factor(ql, "x"), _lens_factor(kvl, "y")
    terms, own = _extras_terms(spec, q, k[1], ex, n)
    extra = "".join(f", {t}" for t in terms)
    dbias = f", {terms[spec.extras.index('bias')]}" if "bias" in spec.extras else ""
    qq = f"b t {n} h"
    rule = (f"{qq}, b s k h, b s k h, {qq}, b {n} t, {qq}, {lq}, {lk}{extra} "
            f"-> {qq}, b s k h, b s k h{dbias}")
    return rule, dict(need_replication_factors=("t", "h", "s", *rq, *rk, *own), **sizes)


partitioned_fwd = custom_partitioning(_fwd_body, static_argnums=(0,))
partitioned_fwd.def_partition(
    partition=_fwd_partition,
    infer_sharding_from_operands=_fwd_infer,
    sharding_rule=_fwd_rule,
)
partitioned_bwd = custom_partitioning(_bwd_body, static_argnums=(0,))
partitioned_bwd.def_partition(
    partition=_bwd_partition,
    infer_sharding_from_operands=_bwd_infer,
    sharding_rule=_bwd_rule,
)
