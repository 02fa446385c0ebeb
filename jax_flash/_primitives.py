"""The forward and backward primitives: abstract evaluation, lowering to the FFI targets
per platform, and batching rules that fold vmapped axes into the kernel's batch or head
dimension.

Operand layouts (what the kernels read):
  q, o, do, dq   [B, T, N, H]
  k, v, dk, dv   [B, S, K, H]     N % K == 0; q head n reads kv head n // (N // K)
  lse            [B, N, T] float32
  q_lens, kv_lens int32 [B], or int32 [0] when absent
  optional operands, after those, present only when named in spec.extras (in EXTRAS order):
  q_segment_ids  int32 [B, T]       kv_segment_ids int32 [B, S]
  bias           float [Bb, Nb, Tb, Sb], each dim 1 (broadcast) or full ([B, N, T, S])
  mask           bool  [Bm, Nm, Tm, Sm], likewise
  dropout        uint32 [B, N, 4]: per (batch, q head) the Philox key (seed lo, seed hi) and the
                 batch and head coordinates of its counters (see cuda/common/philox.h); present
                 iff spec.dropout_rate > 0. Folds like q's batch and heads under vmap, so every
                 folded example keeps its own key and coordinates.
  The backward returns a fourth output, dbias float32 with the bias's shape, iff bias is given.
  The CPU kernels and the portable (sm80) GPU kernels take the optional operands, dropout
  included; on Hopper, kernel="auto" runs the Hopper forward for segment ids, a mask, or a
  bias (read element-wise only at head dims over 64, where it beats the portable forward), in
  any mix, and for dropout alone; the Hopper backward for one of segment ids, bias / mask or
  dropout, without softcap or deterministic; the portable kernels for the other mixes
  (kernel="hopper" with any of them is an error; cuda/common/flash_params.h has the rules).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from . import _ffi

KERNELS = {"auto": 0, "portable": 1, "hopper": 2}

# The optional operands, in operand order (see the module docstring).
EXTRAS = ("q_segment_ids", "kv_segment_ids", "bias", "mask", "dropout")
_BNTS = ("bias", "mask")  # the [B, N, T, S]-broadcast ones


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static description of the attention function (hashable: it is a primitive param)."""

    scale: float
    softcap: float = 0.0  # 0 = off
    window_left: int = -1  # -1 = unbounded
    window_right: int = -1  # -1 = unbounded; causal folds in as 0
    causal: bool = False
    q_offset: int = 0
    bottom_right: bool = False
    deterministic: bool = False
    kernel: str = "auto"
    dropout_rate: float = 0.0  # in [0, 1); > 0 iff the dropout operand is present
    extras: tuple = ()  # names of the optional operands present, in EXTRAS order (not an FFI attr)

    def ffi_attrs(self) -> dict:
        return dict(
            scale=np.float32(self.scale),
            softcap=np.float32(self.softcap),
            window_left=np.int32(self.window_left),
            window_right=np.int32(self.window_right),
            causal=bool(self.causal),
            q_offset=np.int64(self.q_offset),
            bottom_right=bool(self.bottom_right),
            deterministic=bool(self.deterministic),
            kernel=np.int32(KERNELS[self.kernel]),
            dropout_rate=np.float64(self.dropout_rate),
        )


def _round_up(x, m):
    return -(-x // m) * m


# The GPU dQ accumulator's padded shape; mirrors dq_accum_rows/cols in flash_params.h (rows: whole
# 80-row blocks, then a multiple of 128).
def _dq_accum_shape(B, N, T, H):
    return (B, N, _round_up(_round_up(T, 80), 128), _round_up(H, 64))


# ----------------------------------------------------------------------------- forward

flash_fwd_p = jex_core.Primitive("jax_flash_fwd")
flash_fwd_p.multiple_results = True


def _fwd_abstract(q, k, v, q_lens, kv_lens, *extras, spec):
    from . import sharding  # output shardings for Explicit mesh axes (see sharding.py)

    B, T, N, _ = q.shape
    # update() keeps q's other type fields (e.g. shard_map's varying manual axes).
    o_s, lse_s = sharding.fwd_out_shardings(q, k, v, q_lens, kv_lens)
    return (
        q.update(shape=q.shape, dtype=q.dtype, weak_type=False, **o_s),
        q.update(shape=(B, N, T), dtype=jnp.dtype(jnp.float32), weak_type=False, **lse_s),
    )


flash_fwd_p.def_abstract_eval(_fwd_abstract)


GPU_DTYPES = (jnp.bfloat16, jnp.float16)
GPU_MAX_HEAD_DIM = 256


def gpu_kernels_take(dtype, head_dim: int) -> bool:
    """Whether the GPU kernels accept this input dtype and head dim."""
    return dtype in GPU_DTYPES and head_dim <= GPU_MAX_HEAD_DIM


def _check_gpu_operands(q_aval):
    """The GPU kernels take bf16/fp16 and head dims up to 256: fail at compile time, naming
    the problem, rather than in the kernel launch."""
    if q_aval.dtype not in GPU_DTYPES:
        raise TypeError(
            f"jax_flash on the GPU takes bfloat16 or float16 inputs, got {q_aval.dtype}; cast the "
            "inputs (float32 is supported on the CPU backend)")
    if q_aval.shape[-1] > GPU_MAX_HEAD_DIM:
        raise ValueError(f"jax_flash on the GPU supports head dims up to 256, got {q_aval.shape[-1]}")


def _check_gpu_extras(spec, avals_in, n_fixed, backward):
    """kernel='hopper' takes no optional operand (kernel='auto' routes them, per call, to the
    Hopper kernels where those take them); a dbias summed over a broadcast axis uses float
    atomics on the GPU, which deterministic=True cannot promise."""
    if not spec.extras:
        return
    if spec.kernel == "hopper":
        names = ", ".join(n for n in EXTRAS if n in spec.extras and n != "kv_segment_ids")
        raise ValueError(
            f"jax_flash: kernel='hopper' does not take {names}; use kernel='auto' (the Hopper kernels "
            "where they take these inputs, else the portable ones) or 'portable'")
    if backward and spec.deterministic and "bias" in spec.extras:
        B, T, N, _ = avals_in[0].shape
        full = (B, N, T, avals_in[1].shape[1])
        bias = avals_in[n_fixed + spec.extras.index("bias")]
        if any(d == 1 and f > 1 for d, f in zip(bias.shape, full)):
            raise ValueError(
                f"jax_flash: deterministic=True is not supported on the GPU with a bias broadcast to "
                f"[B, N, T, S] = {full} from {tuple(bias.shape)}: its gradient is summed over the broadcast "
                "axes with float atomics. Pass a full-size bias (jnp.broadcast_to) or deterministic=False.")


_ABSENT_DTYPES = {"q_segment_ids": np.int32, "kv_segment_ids": np.int32, "bias": np.float32, "mask": np.bool_,
                  "dropout": np.uint32}


def _with_all_extras(ctx, n_fixed, args, spec):
    """Both platforms' custom calls take every optional operand: absent ones become zero-size
    constants (made here, inside the lowering, so they never cross a sharding or residual
    boundary)."""
    fixed, given = list(args[:n_fixed]), dict(zip(spec.extras, args[n_fixed:]))
    avals = list(ctx.avals_in[:n_fixed])
    given_avals = dict(zip(spec.extras, ctx.avals_in[n_fixed:]))
    for name in EXTRAS:
        if name in given:
            fixed.append(given[name])
            avals.append(given_avals[name])
        else:
            empty = np.zeros((0,), _ABSENT_DTYPES[name])
            fixed.append(mlir.ir_constant(empty))
            avals.append(jax.core.ShapedArray(empty.shape, empty.dtype))
    return ctx.replace(avals_in=avals), fixed


def _workspace_ints(batch: int, chunked_len: int, segment_ids: bool) -> int:
    """Mirrors workspace_ints (cuda/common/flash_params.h): the Hopper kernels' tile counter,
    and with segment ids, after it padded to 16 bytes, four ints per (batch, 64-long chunk) of
    queries (forward: chunked_len = T) or keys (backward: S)."""
    return 4 + 4 * batch * -(-chunked_len // 64) if segment_ids else 1


# Mirrors kBwdSplitSlotInts / bwd_split_slots / bwd_workspace_ints (cuda/common/flash_params.h)
# and JF_BWD_SPLIT_MIN_STEPS (cuda/sm90/flash_bwd_launch_sm90.h).
_BWD_SPLIT_SLOT_INTS = 4 + 2 * 16384
_BWD_SPLIT_MIN_STEPS = 32


def _bwd_workspace_ints(spec, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int) -> int:
    """The Hopper backward's int32 workspace: with segment ids their key-chunk ranges; else, when
    the launch can split its last round of tiles (no causal / window bound, no extras, not
    deterministic, enough steps per key-block tile), the tile counter and room for the split
    tail's partial dK / dV (up to 160 slots of 128 KiB: at most 20 MiB)."""
    if "q_segment_ids" in spec.extras:
        return _workspace_ints(batch, seqlen_k, True)
    split = (spec.window_left < 0 and spec.window_right < 0 and not spec.causal and not spec.deterministic
             and not spec.extras)
    # Steps per tile: query row blocks (64 rows or more per block) times the q heads per kv head.
    split = split and -(-seqlen_q // 64) * (heads_q // heads_kv) >= _BWD_SPLIT_MIN_STEPS
    tiles = batch * heads_kv * -(-seqlen_k // 64)
    slots = 0 if tiles <= 64 else min(tiles, 160)
    return 4 + slots * _BWD_SPLIT_SLOT_INTS if split and slots else 1


def _fwd_local_lowering(ctx, *args, spec, platform):
    if platform == "cuda":
        _check_gpu_operands(ctx.avals_in[0])
        _check_gpu_extras(spec, ctx.avals_in, 5, backward=False)
    ctx, args = _with_all_extras(ctx, 5, args, spec)
    if platform == "cuda":
        # Workspace: the Hopper forward's tile counter (dynamic schedule of causal problems) and,
        # with segment ids, its key ranges per 64-row chunk; an extra output of the call so XLA
        # owns it, dropped here.
        B, T = ctx.avals_in[0].shape[:2]
        ints = _workspace_ints(B, T, "q_segment_ids" in spec.extras)
        ctx = ctx.replace(avals_out=[*ctx.avals_out, jax.core.ShapedArray((ints,), jnp.int32)])
        return jax.ffi.ffi_lowering(_ffi.FWD_TARGET)(ctx, *args, **spec.ffi_attrs())[:2]
    return jax.ffi.ffi_lowering(_ffi.FWD_TARGET)(ctx, *args, **spec.ffi_attrs())


# ---------------------------------------------------------------------------- backward

flash_bwd_p = jex_core.Primitive("jax_flash_bwd")
flash_bwd_p.multiple_results = True


def _bwd_abstract(q, k, v, o, lse, do, q_lens, kv_lens, *extras, spec):
    from . import sharding

    dq_s, dk_s = sharding.bwd_out_shardings(q, k, v, o, lse, do, q_lens, kv_lens)
    outs = (
        q.update(shape=q.shape, dtype=q.dtype, weak_type=False, **dq_s),
        k.update(shape=k.shape, dtype=k.dtype, weak_type=False, **dk_s),
        v.update(shape=v.shape, dtype=v.dtype, weak_type=False, **dk_s),
    )
    if "bias" in spec.extras:  # dbias: float32, the bias's (broadcast) shape and sharding
        bias = dict(zip(spec.extras, extras))["bias"]
        outs += (bias.update(shape=bias.shape, dtype=jnp.dtype(jnp.float32), weak_type=False),)
    return outs


flash_bwd_p.def_abstract_eval(_bwd_abstract)


def _bwd_local_lowering(ctx, *args, spec, platform):
    # Workspaces are extra outputs of the custom call (not scratch allocations inside the
    # kernel), so XLA owns their lifetime; they are dropped here.
    q_aval = ctx.avals_in[0]
    if platform == "cuda":
        _check_gpu_operands(q_aval)
        _check_gpu_extras(spec, ctx.avals_in, 8, backward=True)
    B, T, N, H = q_aval.shape
    acc_shape = _dq_accum_shape(B, N, T, H)
    stats = jax.core.ShapedArray(acc_shape[:3], jnp.float32)
    workspaces = [stats]  # dsum = rowsum(dO * O), padded rows
    if platform == "cuda":
        workspaces += [
            stats,  # lse * log2(e)
            jax.core.ShapedArray((*acc_shape[:2], acc_shape[2] // 64), jnp.int32),  # dQ turn counters
            jax.core.ShapedArray(acc_shape, jnp.float32),  # dQ accumulator
        ]
    outs = list(ctx.avals_out)
    # After the workspaces comes dbias, zero-size without a bias (both platforms); on the GPU
    # then the Hopper backward's segment-range workspace.
    ctx, args = _with_all_extras(ctx, 8, args, spec)
    dbias = outs[3:] or [jax.core.ShapedArray((0,), jnp.float32)]
    tail = []
    if platform == "cuda":
        S, K = ctx.avals_in[1].shape[1:3]
        tail = [jax.core.ShapedArray((_bwd_workspace_ints(spec, B, N, K, T, S),), jnp.int32)]
    ctx = ctx.replace(avals_out=[*outs[:3], *workspaces, *dbias, *tail])
    results = list(jax.ffi.ffi_lowering(_ffi.BWD_TARGET)(ctx, *args, **spec.ffi_attrs()))
    i_dbias = 3 + len(workspaces)
    return results[:3] + [results[i_dbias]] if len(outs) > 3 else results[:3]


# Multi-device lowering. The public primitives lower through a custom_partitioning call
# (jax_flash/sharding.py): its sharding rule lets the SPMD partitioner (Shardy, or GSPMD on
# older setups) keep batch and head sharding, and its per-shard body binds the "local"
# primitives below, which lower straight to the FFI call. custom_partitioning lowers its
# body directly on one device and under shard_map's fully manual context, so those cases
# cost nothing extra. It lives in the lowering, not around the public functions, because
# custom_partitioning has no batching rule (the primitives' batching rules stay in charge).
flash_fwd_local_p = jex_core.Primitive("jax_flash_fwd_local")
flash_fwd_local_p.multiple_results = True
flash_fwd_local_p.def_abstract_eval(_fwd_abstract)
flash_bwd_local_p = jex_core.Primitive("jax_flash_bwd_local")
flash_bwd_local_p.multiple_results = True
flash_bwd_local_p.def_abstract_eval(_bwd_abstract)


def _single_device(ctx) -> bool:
    # jit on one device (eager calls, export without a mesh): no partitioner runs, skip
    # the custom_partitioning wrapper.
    return getattr(ctx.module_context.axis_context, "num_devices", None) == 1


def _lowering(ctx, *args, spec, local_p, partitioned):
    from . import sharding  # imports this module

    # custom_partitioning takes spec as its first (static) argument.
    fn = partial(local_p.bind, spec=spec) if _single_device(ctx) else partial(getattr(sharding, partitioned), spec)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(flash_fwd_p, partial(_lowering, local_p=flash_fwd_local_p, partitioned="partitioned_fwd"))
mlir.register_lowering(flash_bwd_p, partial(_lowering, local_p=flash_bwd_local_p, partitioned="partitioned_bwd"))
try:
    # custom_partitioning needs the device assignment while lowering; JAX only passes it
    # when a primitive in the jaxpr asks (ours hide custom_partitioning in their lowering).
    from jax._src import dispatch as _dispatch

    _dispatch.prim_requires_devices_during_lowering.update((flash_fwd_p, flash_bwd_p))
except (ImportError, AttributeError):  # pragma: no cover - moved in a future JAX
    pass
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(flash_fwd_local_p, partial(_fwd_local_lowering, platform=_platform), platform=_platform)
    mlir.register_lowering(flash_bwd_local_p, partial(_bwd_local_lowering, platform=_platform), platform=_platform)


def _impl(prim, *args, **params):
    return jax.jit(partial(prim.bind, **params))(*args)


flash_fwd_p.def_impl(partial(_impl, flash_fwd_p))
flash_bwd_p.def_impl(partial(_impl, flash_bwd_p))


def _with_extras(spec, extras):
    """(spec naming the present optional operands, those operands in EXTRAS order)."""
    extras = {n: x for n, x in (extras or {}).items() if x is not None}
    unknown = set(extras) - set(EXTRAS)
    assert not unknown, unknown
    names = tuple(n for n in EXTRAS if n in extras)
    return dataclasses.replace(spec, extras=names), [extras[n] for n in names]


def flash_fwd(q, k, v, q_lens, kv_lens, spec: MaskSpec, extras=None):
    """-> (o, lse). extras: {name in EXTRAS: array or None}."""
    spec, ops = _with_extras(spec, extras)
    return flash_fwd_p.bind(q, k, v, q_lens, kv_lens, *ops, spec=spec)


def flash_bwd(q, k, v, o, lse, do, q_lens, kv_lens, spec: MaskSpec, extras=None):
    """-> (dq, dk, dv), plus dbias (float32, the bias's shape) when extras has a bias."""
    spec, ops = _with_extras(spec, extras)
    return flash_bwd_p.bind(q, k, v, o, lse, do, q_lens, kv_lens, *ops, spec=spec)


# ---------------------------------------------------------------------------- batching
#
# A vmapped axis of size V folds into the kernel's problem in one of three ways:
#   * into heads, when q/k/v are all mapped at axis 2 (next to heads): a free reshape
#     [B, L, V, N, H] -> [B, L, V*N, H]; q head v*N + n reads kv head v*K + n // G.
#   * into GQA groups, when only the q side of the forward is mapped (k/v shared): q's
#     axis moves next to heads, [B, T, N, V, H] -> [B, T, N*V, H], so q head n*V + v reads
#     kv head n // G, and k/v are read once, never broadcast.
#   * into batch, otherwise: [V, B, ...] -> [V*B, ...] (free when mapped at axis 0).
# The backward never uses the group fold: under vmap, dk/dv of a shared k/v are still
# per-example values (vmap of grad needs them apart; grad of vmap sums them afterwards),
# so a q-only mapped backward broadcasts k/v into the batch fold, like its V x dk/dv.

_NOT = None  # how JAX marks an unmapped operand


def _size_of(args, dims):
    for a, d in zip(args, dims):
        if d is not _NOT:
            return a.shape[d]
    raise AssertionError("no mapped operand")


def _to_axis(x, d, axis, size):
    """x with its mapped axis at `axis` (broadcast in if unmapped)."""
    if d is _NOT:
        x = jnp.broadcast_to(jnp.expand_dims(x, axis), x.shape[:axis] + (size,) + x.shape[axis:])
        return x
    return jnp.moveaxis(x, d, axis)


def _merge(x, axis):
    """Merge axis with axis + 1."""
    s = x.shape
    return x.reshape(s[:axis] + (s[axis] * s[axis + 1],) + s[axis + 2 :])


def _split(x, axis, size, outer: bool):
    """Inverse of _merge: axis -> (size, rest) if outer else (rest, size)."""
    s = x.shape
    n = s[axis]
    parts = (size, n // size) if outer else (n // size, size)
    return x.reshape(s[:axis] + parts + s[axis + 1 :])


def _lens_for_batch_fold(lens, d, size):
    """Lengths [B] (or absent [0]) for the fold [V, B] -> [V*B]."""
    if lens.shape == (0,) and d is _NOT:
        return lens
    if d is _NOT:
        return jnp.tile(lens, size)
    return jnp.moveaxis(lens, d, 0).reshape(-1)


def _fold_mode(q_side_dims, kv_dims, lens_dims, lse_dim=None, extras_ok=("group", "heads")):
    lens_unmapped = all(d is _NOT for d in lens_dims)
    if all(d is _NOT for d in kv_dims) and lens_unmapped and "group" in extras_ok:
        return "group"
    if (
        lens_unmapped
        and "heads" in extras_ok
        and all(d == 2 for d in q_side_dims)
        and all(d == 2 for d in kv_dims)
        and (lse_dim is None or lse_dim == 1)
    ):
        return "heads"
    return "batch"


# The optional operands under the three folds. Segment ids are per batch element, so they
# survive the head-side folds only unmapped. A bias/mask [Bb, Nb, Tb, Sb] survives the group
# fold unmapped with Nb = 1 (every folded head reads the one head slice); the heads fold
# unmapped with Nb = 1 or mapped with Nb = N (the mapped axis merges in front of N, as q's
# does). The batch fold takes anything; a bias/mask broadcast over batch (Bb = 1) but mapped,
# or unmapped with Bb = B > 1, is expanded there to the folded batch (vmap only).
# `per_example`: the backward's dbias must come out per vmapped example, so there a bias
# summed across the folded axis is not allowed.
# The dropout table [B, N, 4] is per (batch, q head), like q's own [B, N]: every fold takes it,
# moved and merged exactly as q's batch/head axes are (broadcast first when unmapped, which
# gives every example the same key: vmap of a call with one key, as a loop would).


def _extras_modes(spec, extras, dims, N, per_example):
    """Which of the group and heads folds the optional operands allow."""
    ok = {"group", "heads"}
    for name, x, d in zip(spec.extras, extras, dims):
        if name == "dropout":
            continue
        if name not in _BNTS:
            if d is not _NOT:
                ok = set()
            continue
        grad = per_example and name == "bias"
        if d is not _NOT or x.shape[1] != 1 or grad:
            ok.discard("group")
        nb = x.shape[1 if d is _NOT or d > 1 else 2]  # Nb of one example
        if not ((d is not _NOT and nb == N) or (d is _NOT and nb == 1 and not grad)):
            ok.discard("heads")
    return tuple(ok)


def _fold_extras_heads(spec, extras, dims, V):
    out = []
    for name, x, d in zip(spec.extras, extras, dims):
        if d is _NOT and name != "dropout":  # a bias/mask shared over heads as it is
            out.append(x)
        else:  # [.., V, N, ..] -> [.., V*N, ..]: example v's head n is folded head v*N + n
            out.append(_merge(_to_axis(x, d, 1, V), 1))
    return out


def _fold_extras_group(spec, extras, dims, V):
    """The group fold keeps the other operands as they are; the dropout table follows q's
    heads: [B, N, V, 4] -> [B, N*V, 4] (q head n*V + v)."""
    return [_merge(_to_axis(x, d, 2, V), 1) if name == "dropout" else x
            for name, x, d in zip(spec.extras, extras, dims)]


def _fold_extras_batch(spec, extras, dims, V, B, per_example):
    """Optional operands for the fold [V, B] -> [V*B] (B: the unmapped batch size)."""
    out = []
    for name, x, d in zip(spec.extras, extras, dims):
        if name in _BNTS and d is _NOT and x.shape[0] == 1 and not (per_example and name == "bias"):
            out.append(x)  # broadcast over every folded batch element as it is
            continue
        x = _to_axis(x, d, 0, V)
        if name in _BNTS and x.shape[1] != B:
            x = jnp.broadcast_to(x, (V, B) + x.shape[2:])
        out.append(_merge(x, 0))
    return out


def _batch_of_nothing(prim, args, dims, spec):
    """vmap over an axis of size 0: empty outputs of the right shapes (the folds below divide by
    the mapped size, and there is nothing to compute)."""
    one = [jax.ShapeDtypeStruct(x.shape if d is _NOT else x.shape[:d] + x.shape[d + 1 :], x.dtype)
           for x, d in zip(args, dims)]
    outs = jax.eval_shape(partial(prim.bind, spec=spec), *one)
    return tuple(jnp.zeros((0,) + o.shape, o.dtype) for o in outs), (0,) * len(outs)


def _fwd_batch(args, dims, *, spec):
    q, k, v, ql, kvl, *ex = args
    qd, kd, vd, qld, kvld, *exd = dims
    V = _size_of(args, dims)
    if V == 0:
        return _batch_of_nothing(flash_fwd_p, args, dims, spec)
    N = q.shape[3] if qd is not _NOT and qd <= 2 else q.shape[2]  # heads of one example
    mode = _fold_mode([qd], [kd, vd], [qld, kvld], extras_ok=_extras_modes(spec, ex, exd, N, False))
    if mode == "group":
        q = _merge(_to_axis(q, qd, 3, V), 2)
        ex = _fold_extras_group(spec, ex, exd, V)
        o, lse = flash_fwd_p.bind(q, k, v, ql, kvl, *ex, spec=spec)
        return (_split(o, 2, V, outer=False), _split(lse, 1, V, outer=False)), (3, 2)
    if mode == "heads":
        q, k, v = (_merge(x, 2) for x in (q, k, v))
        ex = _fold_extras_heads(spec, ex, exd, V)
        o, lse = flash_fwd_p.bind(q, k, v, ql, kvl, *ex, spec=spec)
        return (_split(o, 2, V, outer=True), _split(lse, 1, V, outer=True)), (2, 1)
    B = q.shape[1] if qd == 0 else q.shape[0]
    q, k, v = (_merge(_to_axis(x, d, 0, V), 0) for x, d in ((q, qd), (k, kd), (v, vd)))
    ql, kvl = _lens_for_batch_fold(ql, qld, V), _lens_for_batch_fold(kvl, kvld, V)
    ex = _fold_extras_batch(spec, ex, exd, V, B, per_example=False)
    o, lse = flash_fwd_p.bind(q, k, v, ql, kvl, *ex, spec=spec)
    return (_split(o, 0, V, outer=True), _split(lse, 0, V, outer=True)), (0, 0)


def _bwd_batch(args, dims, *, spec):
    q, k, v, o, lse, do, ql, kvl, *ex = args
    qd, kd, vd, od, lsed, dod, qld, kvld, *exd = dims
    V = _size_of(args, dims)
    if V == 0:
        return _batch_of_nothing(flash_bwd_p, args, dims, spec)
    N = q.shape[3] if qd is not _NOT and qd <= 2 else q.shape[2]
    mode = _fold_mode([qd, od, dod], [kd, vd], [qld, kvld], lse_dim=lsed,
                      extras_ok=tuple(m for m in _extras_modes(spec, ex, exd, N, True) if m == "heads"))
    if mode == "heads":
        q, k, v, o, do = (_merge(x, 2) for x in (q, k, v, o, do))
        lse = _merge(lse, 1)
        ex = _fold_extras_heads(spec, ex, exd, V)
        outs = flash_bwd_p.bind(q, k, v, o, lse, do, ql, kvl, *ex, spec=spec)
        dq, dk, dv = (_split(x, 2, V, outer=True) for x in outs[:3])
        if len(outs) == 3:
            return (dq, dk, dv), (2, 2, 2)
        return (dq, dk, dv, _split(outs[3], 1, V, outer=True)), (2, 2, 2, 1)  # dbias [Bb, V, N, T, S]
    B = q.shape[1] if qd == 0 else q.shape[0]
    q, k, v, o, lse, do = (
        _merge(_to_axis(x, d, 0, V), 0)
        for x, d in ((q, qd), (k, kd), (v, vd), (o, od), (lse, lsed), (do, dod))
    )
    ql, kvl = _lens_for_batch_fold(ql, qld, V), _lens_for_batch_fold(kvl, kvld, V)
    bias_b = dict(zip(spec.extras, ex)).get("bias")
    ex = _fold_extras_batch(spec, ex, exd, V, B, per_example=True)
    outs = flash_bwd_p.bind(q, k, v, o, lse, do, ql, kvl, *ex, spec=spec)
    dq, dk, dv = (_split(x, 0, V, outer=True) for x in outs[:3])
    if len(outs) == 3:
        return (dq, dk, dv), (0, 0, 0)
    dbias = _split(outs[3], 0, V, outer=True)  # [V, B or Bb, ...]
    bias_dim = exd[spec.extras.index("bias")]
    bb = bias_b.shape[0] if bias_dim is _NOT or bias_dim > 0 else bias_b.shape[1]
    if bb == 1 and dbias.shape[1] != 1:  # expanded over batch for the fold: sum it back
        dbias = dbias.sum(axis=1, keepdims=True)
    return (dq, dk, dv, dbias), (0, 0, 0, 0)


batching.primitive_batchers[flash_fwd_p] = _fwd_batch
batching.primitive_batchers[flash_bwd_p] = _bwd_batch


# First-order derivatives come from attention.py's custom_vjp; differentiating again (grad of
# grad, hessian) reaches the primitives themselves, which have no derivative: say so, rather
# than JAX's "Differentiation rule for 'jax_flash_fwd' not implemented".
def _no_derivative(name):
    def rule(primals, tangents, **params):
        raise NotImplementedError(
            f"jax_flash ({name}): only first-order reverse-mode derivatives are supported "
            "(grad, vjp, jacrev, value_and_grad, under jit / vmap / checkpoint); grad of grad, "
            "hessian and forward-mode (jvp, jacfwd) are not")
    return rule


for _p in (flash_fwd_p, flash_bwd_p):
    ad.primitive_jvps[_p] = _no_derivative(_p.name)
