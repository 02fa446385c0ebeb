"""Packed sequences (segment ids), additive bias (with dbias) and boolean masks: outputs,
lse and every gradient against the float64 reference and against jax.nn's XLA attention;
broadcast shapes; rows left with no key; vmap/jit; errors; the GPU dispatch (lowered for
CUDA from this CPU machine)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash import reference
from conftest import assert_flash_rule, assert_vmap_matches_loop, max_err, random_qkv, run_reference, vjp_fn

F32 = jnp.float32


def packed_ids(key, B, L, n_segments, sort=True):
    """Random segment ids [B, L] in [0, n_segments): sorted (packed sequences) or not."""
    ids = jax.random.randint(jax.random.key(key), (B, L), 0, n_segments)
    return jnp.sort(ids, axis=1) if sort else ids


def rand_bias(key, shape, dtype=F32):
    return jax.random.normal(jax.random.key(key), shape, F32).astype(dtype)


def rand_mask(key, shape, p=0.8):
    return jax.random.bernoulli(jax.random.key(key), p, shape)


# ------------------------------------------------------------- against the float64 reference


def check_case(B, T, S, N, K, H, dtype, ours, ref, bias_shape=None, seed=0, bias_dtype=F32):
    """ours/ref: (q, k, v, bias) -> (out [B,T,N,H], lse [B,N,T]); ref also takes compute_dtype.
    FlashAttention's rule (2x the naive error) on out, dq, dk, dv and dbias."""
    q, k, v = random_qkv(seed, B, T, S, N, K, H, dtype)
    bias = None if bias_shape is None else rand_bias(seed + 1, bias_shape, bias_dtype)
    do = jax.random.normal(jax.random.key(seed + 2), q.shape, F32).astype(dtype)
    wb = bias is not None
    o, lse, g = vjp_fn(ours, wb)(q, k, v, bias, do)
    o64, lse64, g64 = run_reference(vjp_fn(lambda *a: ref(*a, compute_dtype=jnp.float64), wb),
                                    *(None if x is None else x.astype(jnp.float64) for x in (q, k, v, bias, do)))
    on, _, gn = run_reference(vjp_fn(lambda *a: ref(*a, compute_dtype=jnp.dtype(dtype)), wb), q, k, v, bias, do)
    assert o.dtype == q.dtype and lse.dtype == F32
    assert not jnp.isnan(o).any() and not jnp.isnan(lse).any()
    assert_flash_rule("out", o, on, o64, dtype)
    lse_scale = max(1.0, float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(lse64), lse64, 0)))))
    assert max_err(lse, lse64) <= (1e-5 if dtype == F32 else 2e-2) * lse_scale
    names = ("dq", "dk", "dv", "dbias")
    for name, a, b, c in zip(names, g, gn, g64):
        assert not jnp.isnan(a).any(), name
        if name == "dbias":
            assert a.shape == bias.shape and a.dtype == bias.dtype
        assert_flash_rule(name, a, b, c, dtype)
    return o, lse, g


def dropin(**kw):
    """jax_flash.dot_product_attention as (q, k, v, bias) -> (out, lse [B, N, T])."""

    def fn(q, k, v, bias):
        o, lse = jax_flash.dot_product_attention(q, k, v, bias, return_residual=True, **kw)
        return o, jnp.swapaxes(lse, 1, 2)

    return fn


def ref_of(**kw):
    return lambda q, k, v, bias, compute_dtype: reference.attention(q, k, v, bias=bias, compute_dtype=compute_dtype, **kw)


# (B, T, S, N, K, H): GQA and odd lengths everywhere.
SHAPE = (2, 67, 67, 4, 2, 24)


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_segment_ids_causal_gqa(dtype):
    """Packed self-attention: sorted ids (whole off-diagonal tiles skipped) with causal."""
    B, T, S, N, K, H = SHAPE
    ids = packed_ids(1, B, T, 4)
    check_case(*SHAPE, dtype, dropin(is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids),
               ref_of(causal=True, q_segment_ids=ids, kv_segment_ids=ids))


def test_segment_ids_unsorted_with_window_lengths_softcap():
    """Unsorted ids (element-wise only) with T != S, a window, lengths and softcap."""
    B, T, S, N, K, H = 2, 45, 77, 4, 1, 16
    qi, ki = packed_ids(2, B, T, 3, sort=False), packed_ids(3, B, S, 3, sort=False)
    kvl = jnp.array([77, 50], jnp.int32)
    kw = dict(query_segment_ids=qi, key_value_segment_ids=ki, local_window_size=(20, 9), softcap=3.0,
              key_value_seq_lengths=kvl)
    check_case(B, T, S, N, K, H, F32, dropin(**kw),
               ref_of(q_segment_ids=qi, kv_segment_ids=ki, window=(20, 9), softcap=3.0, kv_lens=kvl))


# Bias shapes: full (dbias written by the owning task), broadcast over B / over N with K > 1
# (dbias in the separate pass), over keys (column stride 0) and over queries.
BIAS_SHAPES = {
    "full": (2, 4, 67, 67),
    "over_batch": (1, 4, 67, 67),
    "over_heads": (2, 1, 67, 67),
    "over_keys": (2, 4, 67, 1),
    "keys_only": (1, 1, 1, 67),
}


@pytest.mark.parametrize("case", list(BIAS_SHAPES))
def test_bias_broadcast_and_dbias(case):
    check_case(*SHAPE, F32, dropin(is_causal=True), ref_of(causal=True), bias_shape=BIAS_SHAPES[case])


def test_bias_softcap_order_float16():
    """The bias is added after softcap (an additive mask is not squashed by the cap)."""
    check_case(*SHAPE, jnp.float16, dropin(softcap=2.0), ref_of(softcap=2.0), bias_shape=(1, 4, 67, 67))
    q, k, v = random_qkv(5, 1, 8, 8, 1, 1, 16, F32)
    pad = jnp.where(jnp.arange(8) < 5, 0.0, -1e9)[None, None, None, :]  # padding as a bias
    got = jax_flash.dot_product_attention(q, k, v, pad, softcap=1.0)
    want = jax_flash.dot_product_attention(q, k, v, softcap=1.0, key_value_seq_lengths=jnp.array([5], jnp.int32))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_mask_broadcast_with_everything_bfloat16():
    """mask [B, 1, T, S] with segment ids, a bias broadcast over batch, lengths and causal."""
    B, T, S, N, K, H = SHAPE
    ids = packed_ids(6, B, T, 2)
    mask = rand_mask(7, (B, 1, T, S))
    ql = jnp.array([67, 40], jnp.int32)
    check_case(*SHAPE, jnp.bfloat16,
               dropin(is_causal=True, mask=mask, query_segment_ids=ids, key_value_segment_ids=ids, query_seq_lengths=ql),
               ref_of(causal=True, mask=mask, q_segment_ids=ids, kv_segment_ids=ids, q_lens=ql),
               bias_shape=(1, 4, T, S))


def test_core_flash_attention_features():
    """The single-head core: leading dims [B, N]; a bias over B only (expanded over N: one batch
    stride cannot express it), a mask [T, S] (broadcast over every leading dim)."""
    B, T, S, N, H = 2, 33, 41, 3, 16
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in random_qkv(8, B, T, S, N, N, H, F32))  # [B, N, L, H]
    qi, ki = packed_ids(9, B, T, 3), packed_ids(10, B, S, 3)
    bias = rand_bias(11, (B, 1, T, S))
    mask = rand_mask(12, (T, S))
    qi_l, ki_l = (jnp.broadcast_to(x[:, None], (B, N, x.shape[1])) for x in (qi, ki))

    def ours(q, k, v, bias):
        o, lse = jax_flash.flash_attention(q, k, v, causal=True, q_segment_ids=qi_l, kv_segment_ids=ki_l,
                                           bias=bias, mask=mask, return_lse=True)
        return jnp.swapaxes(o, 1, 2), lse

    def ref(q, k, v, bias, compute_dtype):
        return reference.attention(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                   causal=True, q_segment_ids=qi, kv_segment_ids=ki, bias=bias, mask=mask,
                                   compute_dtype=compute_dtype)

    g = jax.jit(jax.value_and_grad(lambda q, k, v, b: jnp.sum(ours(q, k, v, b)[0] ** 2), argnums=(0, 1, 2, 3)))
    r = jax.jit(jax.value_and_grad(lambda q, k, v, b: jnp.sum(ref(q, k, v, b, jnp.float64)[0] ** 2), argnums=(0, 1, 2, 3)))
    (l1, g1), (l2, g2) = g(q, k, v, bias), r(*(x.astype(jnp.float64) for x in (q, k, v, bias)))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------- against jax.nn (XLA)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["GQA", "MQA"])
def test_parity_with_jax_nn(heads):
    """Segment ids as jax.nn's mask, plus a bias broadcast over batch and a mask over heads."""
    N, K = heads
    B, T, S, H = 2, 29, 29, 16
    q, k, v = random_qkv(13, B, T, S, N, K, H, F32)
    ids = packed_ids(14, B, T, 3)
    bias = rand_bias(15, (1, N, T, S))
    mask = rand_mask(16, (B, 1, T, S)) | jnp.eye(T, S, dtype=bool)  # every row keeps a key
    seg_mask = ids[:, None, :, None] == ids[:, None, None, :]
    do = jax.random.normal(jax.random.key(17), q.shape, F32)
    ours = lambda q, k, v, b: jax_flash.dot_product_attention(
        q, k, v, b, mask, is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids)
    xla = lambda q, k, v, b: jax.nn.dot_product_attention(
        q, k, v, b, mask & seg_mask, is_causal=True, implementation="xla")
    o1, vjp1 = jax.vjp(ours, q, k, v, bias)
    o2, vjp2 = jax.vjp(xla, q, k, v, bias)
    np.testing.assert_allclose(o1, o2, atol=2e-5, rtol=2e-5)
    for a, b in zip(vjp1(do), vjp2(do)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5)
    # implementation="xla" takes the segment ids too (as a mask).
    o3 = jax_flash.dot_product_attention(q, k, v, bias, mask, is_causal=True, query_segment_ids=ids,
                                         key_value_segment_ids=ids, implementation="xla")
    np.testing.assert_allclose(o3, o2, atol=1e-6)


def test_unbatched_layout():
    q, k, v = random_qkv(18, 1, 12, 12, 2, 2, 8, F32)
    ids = packed_ids(19, 1, 12, 2)[0]
    bias = rand_bias(20, (2, 12, 12))
    o = jax_flash.dot_product_attention(q[0], k[0], v[0], bias, query_segment_ids=ids, key_value_segment_ids=ids)
    want = jax_flash.dot_product_attention(q, k, v, bias[None], query_segment_ids=ids[None],
                                           key_value_segment_ids=ids[None])[0]
    assert o.shape == (12, 2, 8)
    np.testing.assert_allclose(o, want, atol=1e-6)


# ------------------------------------------------------------------------- empty rows


def test_rows_without_keys_are_zero_with_zero_grads():
    """A query segment with no key (id 7 only on the query side) and a fully masked row:
    output 0, lse -inf, zero gradients (dbias too), never NaN. jax.nn would average V."""
    B, T, S, N, K, H = 2, 10, 12, 2, 1, 8
    q, k, v = random_qkv(21, B, T, S, N, K, H, F32)
    qi = jnp.array([[0] * 4 + [7] * 3 + [1] * 3, [0] * 10], jnp.int32)
    ki = jnp.array([[0] * 6 + [1] * 6, [0] * 12], jnp.int32)
    mask = jnp.ones((B, 1, T, S), bool).at[1, :, 2].set(False)  # batch 1, row 2 sees nothing
    bias = rand_bias(22, (B, N, T, S))
    f = lambda q, k, v, b: jax_flash.dot_product_attention(
        q, k, v, b, mask, query_segment_ids=qi, key_value_segment_ids=ki, return_residual=True)
    (o, lse), vjp = jax.vjp(f, q, k, v, bias)
    empty = [(0, slice(4, 7)), (1, slice(2, 3))]
    for b, rows in empty:
        assert jnp.all(o[b, rows] == 0) and jnp.all(jnp.isneginf(lse[b, rows]))
    assert jnp.isfinite(lse[0, :4]).all() and jnp.isfinite(lse[1, 3:]).all()
    dq, dk, dv, db = vjp((jnp.ones_like(o), jnp.zeros_like(lse)))
    for g in (dq, dk, dv, db):
        assert not jnp.isnan(g).any()
    assert jnp.all(dq[0, 4:7] == 0) and jnp.all(dq[1, 2] == 0)
    assert jnp.all(db[0, :, 4:7] == 0) and jnp.all(db[1, :, 2] == 0)
    o_ref, lse_ref = reference.attention(q, k, v, q_segment_ids=qi, kv_segment_ids=ki, bias=bias, mask=mask,
                                         compute_dtype=F32)
    np.testing.assert_allclose(o, o_ref, atol=2e-6)


# ------------------------------------------------------------------------ transforms


def core(q, k, v, qi, ki, bias, mask):
    return jax_flash.flash_attention(q, k, v, causal=True, q_segment_ids=qi, kv_segment_ids=ki, bias=bias, mask=mask)


def _args(seed, T=19, S=19, H=8, V=3):
    q, k, v = (rand_bias(seed + i, (V, L, H)) for i, L in enumerate((T, S, S)))
    qi, ki = packed_ids(seed + 3, V, T, 2), packed_ids(seed + 4, V, S, 2)
    return q, k, v, qi, ki, rand_bias(seed + 5, (V, T, S)), rand_mask(seed + 6, (V, T, S))


@pytest.mark.parametrize("in_axes", [
    (0, 0, 0, 0, 0, 0, 0),  # everything mapped: batch fold
    (0, 0, 0, None, None, None, None),  # shared ids/bias/mask
    (0, None, None, None, None, None, None),  # q alone: the GQA-group fold (bias/mask shared)
    (0, 0, 0, None, None, 0, None),  # per-example bias
], ids=["all", "shared_extras", "q_only", "bias_only"])
def test_vmap_matches_loop(in_axes):
    assert_vmap_matches_loop(core, _args(30), in_axes)


def test_vmap_over_heads_axis_of_dot_product_attention():
    """vmap next to heads (the heads fold) with a per-example bias over heads."""
    q, k, v = random_qkv(31, 2, 9, 12, 4, 2, 16, F32)
    stack = lambda x, ax: jnp.stack([x, 2 * x, -x], axis=ax)
    bias = rand_bias(32, (2, 4, 9, 12))
    qs, ks, vs = (stack(x, 2) for x in (q, k, v))
    bs = stack(bias, 1)
    got = jax.vmap(lambda q, k, v, b: jax_flash.dot_product_attention(q, k, v, b, is_causal=True),
                   in_axes=(2, 2, 2, 1), out_axes=2)(qs, ks, vs, bs)
    for j, s in enumerate((1, 2, -1)):
        want = jax_flash.dot_product_attention(s * q, s * k, s * v, s * bias, is_causal=True)
        np.testing.assert_allclose(got[:, :, j], want, rtol=1e-5, atol=1e-5)


VMAP_GRAD_CASES = {  # name: (bias shape, bias in_axis, mask mapped?, q/k/v in_axis)
    "heads_fold_bias_per_head": ((2, 4, 9, 12), 1, False, 2),
    "batch_fold_bias_over_batch": ((1, 4, 9, 12), 1, False, 0),
    "shared_bias_mapped_mask": ((1, 1, 9, 12), None, True, 2),
    "shared_bias_over_heads": ((2, 1, 9, 12), None, False, 0),
}


@pytest.mark.parametrize("case", list(VMAP_GRAD_CASES))
def test_vmap_of_grad_dropin(case):
    """vmap of grad (q, k, v, bias) through every fold, against one call per example."""
    bias_shape, b_ax, mask_mapped, ax = VMAP_GRAD_CASES[case]
    q, k, v = random_qkv(33, 2, 9, 12, 4, 2, 16, F32)
    bias = rand_bias(34, bias_shape)
    mask = rand_mask(35, (2, 4, 9, 12)) | jnp.eye(9, 12, dtype=bool)
    masks = jnp.stack([mask, ~mask | jnp.eye(9, 12, dtype=bool), mask], axis=1)
    scales = (1, 2, -1)
    stack = lambda x, a: jnp.stack([s * x for s in scales], axis=a)
    loss = lambda q, k, v, b, m: jnp.sum(jax_flash.dot_product_attention(q, k, v, b, m, is_causal=True) ** 2)
    g = jax.grad(loss, argnums=(0, 1, 2, 3))
    in_axes = (ax, ax, ax, b_ax, 1 if mask_mapped else None)
    args = (*(stack(x, ax) for x in (q, k, v)), bias if b_ax is None else stack(bias, b_ax),
            masks if mask_mapped else mask)
    got = jax.jit(jax.vmap(g, in_axes=in_axes))(*args)
    for j, s in enumerate(scales):
        want = g(s * q, s * k, s * v, bias if b_ax is None else s * bias, masks[:, j] if mask_mapped else mask)
        for a, w in zip(got, want):
            np.testing.assert_allclose(a[j], w, rtol=2e-4, atol=2e-4)


def test_vmap_of_grad_gives_per_example_dbias():
    """A bias shared by the vmapped examples still gets per-example gradients, and grad of vmap
    their sum."""
    q, k, v, qi, ki, bias, mask = _args(40)
    bias = bias[0]
    loss = lambda q, k, v, b, qi, ki: jnp.sum(core(q, k, v, qi, ki, b, mask[0]) ** 2)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 3)), in_axes=(0, 0, 0, None, 0, 0)))(q, k, v, bias, qi, ki)
    for j in range(3):
        dq, db = jax.grad(loss, argnums=(0, 3))(q[j], k[j], v[j], bias, qi[j], ki[j])
        np.testing.assert_allclose(grads[0][j], dq, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grads[1][j], db, rtol=1e-5, atol=1e-6)
    total = jax.grad(lambda b: jnp.sum(jax.vmap(loss, in_axes=(0, 0, 0, None, 0, 0))(q, k, v, b, qi, ki)))(bias)
    np.testing.assert_allclose(total, grads[1].sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_sharded_batch_and_heads(axis_type):
    """Batch x head sharding with segment ids and a bias broadcast over batch (its dbias is
    summed over the batch shards) equals one device."""
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 host devices")
    if axis_type == AxisType.Explicit and tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11):
        pytest.xfail("known limitation: on JAX 0.11 an Explicit mesh leaves an unlowerable 'Sharding' "
                     "custom call in the all-reduce that sums dbias over the batch shards (works on JAX 0.10)")
    q, k, v = random_qkv(50, 4, 16, 16, 4, 2, 8, F32)
    ids = packed_ids(51, 4, 16, 2)
    bias = rand_bias(52, (1, 4, 16, 16))
    loss = lambda q, k, v, b, ids: jnp.sum(jax_flash.dot_product_attention(
        q, k, v, b, query_segment_ids=ids, key_value_segment_ids=ids, is_causal=True) ** 2)
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    want = grad(q, k, v, bias, ids)
    mesh = jax.make_mesh((2, 2), ("d", "h"), axis_types=(axis_type,) * 2, devices=jax.devices("cpu")[:4])
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    args = (put(q, "d", None, "h"), put(k, "d", None, "h"), put(v, "d", None, "h"), put(bias), put(ids, "d"))
    with jax.set_mesh(mesh):
        got = jax.jit(grad)(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------- errors


def _qkv():
    return random_qkv(0, 2, 8, 8, 4, 2, 16, F32)


IDS8 = jnp.zeros((2, 8), jnp.int32)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(query_segment_ids=IDS8), ValueError, "key_value_segment_ids is missing"),
    (dict(query_segment_ids=IDS8, key_value_segment_ids=IDS8[:, :5]), ValueError,
     r"key_value_segment_ids must have shape \(2, 8\)"),
    (dict(query_segment_ids=IDS8.astype(F32), key_value_segment_ids=IDS8), TypeError,
     "query_segment_ids must be an integer array"),
    (dict(bias=jnp.zeros((8, 7))), ValueError, r"bias of shape \(8, 7\) is not broadcastable to \[B, N, T, S\]"),
    (dict(bias=jnp.zeros((1, 2, 3, 8, 8))), ValueError, "bias of shape"),
    (dict(bias=jnp.zeros((8, 8), jnp.int32)), TypeError, "bias must be a floating-point array"),
    (dict(mask=jnp.ones((8, 8), jnp.float32)), TypeError, "mask must be a boolean array"),
    (dict(mask=jnp.ones((3, 1, 8, 8), bool)), ValueError, "mask of shape"),
])
def test_argument_errors(kw, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, **kw)).lower(q, k, v)


def test_core_argument_errors():
    x = jnp.zeros((2, 8, 16), F32)
    with pytest.raises(ValueError, match="kv_segment_ids and|q_segment_ids and kv_segment_ids go together"):
        jax_flash.flash_attention(x, x, x, kv_segment_ids=IDS8)
    with pytest.raises(ValueError, match=r"q_segment_ids must have shape \(2, 8\)"):
        jax_flash.flash_attention(x, x, x, q_segment_ids=IDS8[0], kv_segment_ids=IDS8)
    with pytest.raises(ValueError, match=r"bias of shape \(3, 8, 8\) is not broadcastable to q.shape"):
        jax_flash.flash_attention(x, x, x, bias=jnp.zeros((3, 8, 8)))


# ------------------------------------------------------------------------ GPU dispatch


def _cuda_custom_calls(fn, *args):
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=jax_flash.export_disabled_checks())(*args)
    return re.findall(r"custom_call @(\w+)", exp.mlir_module())


_GPU_KW = {
    "q_segment_ids": dict(q_segment_ids=IDS8.repeat(2, 1), kv_segment_ids=IDS8.repeat(2, 1)),
    "bias": dict(bias=jnp.zeros((16, 16))),
    "mask": dict(mask=jnp.ones((16, 16), bool)),
}


@pytest.mark.parametrize("feature", list(_GPU_KW))
def test_core_on_gpu_lowers_to_the_kernels(feature):
    """Segment ids, bias and mask lower to the CUDA kernels (forward and backward), with the
    optional operands passed like on the CPU."""
    q = jnp.zeros((2, 16, 16), jnp.bfloat16)
    kw = _GPU_KW[feature]
    f = lambda q: jax_flash.flash_attention(q, q, q, **kw)
    assert _cuda_custom_calls(f, q) == ["jax_flash_fwd"]
    assert _cuda_custom_calls(jax.grad(lambda q: jnp.sum(f(q).astype(F32))), q) == ["jax_flash_fwd", "jax_flash_bwd"]
    if feature == "bias":  # dbias comes back from the CUDA backward too
        g = lambda q, b: jnp.sum(jax_flash.flash_attention(q, q, q, bias=b).astype(F32))
        calls = _cuda_custom_calls(jax.grad(g, argnums=(0, 1)), q, kw["bias"])
        assert calls == ["jax_flash_fwd", "jax_flash_bwd"]


@pytest.mark.parametrize("T, S", [(16, 16), (64, 65), (65, 300), (300, 64)])
def test_gpu_workspaces_hold_the_segment_ranges(T, S):
    """The CUDA calls' int32 workspaces: the forward's tile counter alone, or with segment ids the
    counter padded to 16 bytes and one 4-int key range per (batch, 64-row chunk) of queries
    (workspace_ints, cuda/common/flash_params.h); the backward's, one 4-int row range per
    (batch, 64-key chunk). The Hopper kernels fill them."""
    B = 3
    q, kv = jnp.zeros((B, T, 16), jnp.bfloat16), jnp.zeros((B, S, 16), jnp.bfloat16)
    ids_q, ids_k = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)

    def workspaces(**kw):
        f = lambda q: jnp.sum(jax_flash.flash_attention(q, kv, kv, **kw).astype(F32))
        exp = export.export(jax.jit(jax.grad(f)), platforms=["cuda"],
                            disabled_checks=jax_flash.export_disabled_checks())(q)
        last = {}
        for ln in exp.mlir_module().splitlines():
            for name in ("jax_flash_fwd", "jax_flash_bwd"):
                if f"custom_call @{name}" in ln:
                    last[name] = re.findall(r"tensor<(\d+)xi32>", ln.split("->")[-1])[-1]
        return last["jax_flash_fwd"], last["jax_flash_bwd"]

    assert workspaces() == ("1", "1")
    assert workspaces(q_segment_ids=ids_q, kv_segment_ids=ids_k) == (
        str(4 + 4 * B * -(-T // 64)), str(4 + 4 * B * -(-S // 64)))


@pytest.mark.parametrize("T, S, causal, slots", [
    (2048, 4200, False, 66),   # 66 key chunks of 64, 32 row blocks of 64: room for the split tail
    (2048, 20000, False, 160),  # at most 160 slots (20 MiB)
    (1984, 4200, False, 0),    # 31 row blocks: too few steps per tile to split (JF_BWD_SPLIT_MIN_STEPS)
    (2048, 4096, False, 0),    # 64 key chunks: never more tiles than SMs
    (2048, 4200, True, 0),     # causal: the dynamic schedule, no split
])
def test_gpu_backward_workspace_holds_the_split_tail(T, S, causal, slots):
    """Without segment ids the Hopper backward's int32 workspace is the tile counter and, for a
    launch that may split its last round of key-block tiles (NOTES.md v82b), one slot of 4 + 2 *
    16384 ints (two step counts, two WGs' dK / dV partial sums) per tile of that round, bounded
    by 160; otherwise a single int."""
    q, kv = jnp.zeros((1, T, 64), jnp.bfloat16), jnp.zeros((1, S, 64), jnp.bfloat16)
    f = lambda q: jnp.sum(jax_flash.flash_attention(q, kv, kv, causal=causal).astype(F32))
    exp = export.export(jax.jit(jax.grad(f)), platforms=["cuda"],
                        disabled_checks=jax_flash.export_disabled_checks())(q)
    bwd = [ln for ln in exp.mlir_module().splitlines() if "custom_call @jax_flash_bwd" in ln]
    assert len(bwd) == 1
    ints = int(re.findall(r"tensor<(\d+)xi32>", bwd[0].split("->")[-1])[-1])
    assert ints == (4 + slots * (4 + 2 * 16384) if slots else 1)


@pytest.mark.parametrize("feature", list(_GPU_KW))
def test_gpu_hopper_kernel_with_extras_is_an_error(feature):
    q = jnp.zeros((2, 16, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"kernel='hopper' does not take {feature}"):
        _cuda_custom_calls(lambda q: jax_flash.flash_attention(q, q, q, kernel="hopper", **_GPU_KW[feature]), q)
    # The CPU ignores `kernel`.
    jax_flash.flash_attention(q, q, q, kernel="hopper", **_GPU_KW[feature])


def test_gpu_deterministic_with_broadcast_bias_is_an_error():
    q = jnp.zeros((2, 16, 16), jnp.bfloat16)
    g = lambda q, b: jnp.sum(jax_flash.flash_attention(q, q, q, bias=b, deterministic=True).astype(F32))
    grad = jax.grad(g, argnums=(0, 1))
    with pytest.raises(ValueError, match="deterministic=True is not supported on the GPU with a bias broadcast"):
        _cuda_custom_calls(grad, q, jnp.zeros((16, 16)))  # [1, 1, T, S] over batch 2
    # A full-size bias (one dS per dbias element) stays deterministic; the forward alone is fine.
    assert _cuda_custom_calls(grad, q, jnp.zeros((2, 16, 16))) == ["jax_flash_fwd", "jax_flash_bwd"]
    f = lambda q, b: jax_flash.flash_attention(q, q, q, bias=b, deterministic=True)
    assert _cuda_custom_calls(f, q, jnp.zeros((16, 16))) == ["jax_flash_fwd"]
    # The CPU backend is deterministic for every bias shape.
    grad(q.astype(F32), jnp.zeros((16, 16)))


def test_dropin_on_gpu_runs_the_kernels(monkeypatch):
    import warnings

    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    bias, ids = jnp.zeros((1, 4, 8, 8), F32), IDS8
    mask = jnp.ones((2, 1, 8, 8), bool)
    f = lambda q, k, v, b: jax_flash.dot_product_attention(q, k, v, b, mask, query_segment_ids=ids,
                                                           key_value_segment_ids=ids, softcap=5.0)
    loss = lambda *a: jnp.sum(f(*a).astype(F32))
    # Lowered for the GPU: jax_flash's kernels, forward and backward (also with softcap).
    assert _cuda_custom_calls(f, q, k, v, bias) == ["jax_flash_fwd"]
    assert _cuda_custom_calls(jax.grad(loss, argnums=(0, 3)), q, k, v, bias) == ["jax_flash_fwd", "jax_flash_bwd"]
    # No fallback, so no warning on a GPU default backend either; the CPU runs the kernels.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_flash.JaxFlashFallbackWarning)
        out = f(q, k, v, bias)
    want = reference.attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, bias=bias, mask=mask, softcap=5.0,
                               compute_dtype=F32)[0]
    np.testing.assert_allclose(np.asarray(out, F32), np.asarray(want), atol=2e-2)
