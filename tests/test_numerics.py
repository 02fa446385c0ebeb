"""Outputs, lse and all three gradients against a float64 reference, under FlashAttention's
2x rule, over a grid of shapes and every mask feature (runs on the default backend)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_flash
from jax_flash import reference
from conftest import assert_flash_rule, max_err, random_qkv, run_reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# (B, T, S, N, K, H)
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 1, 77, 4, 2, 64),  # single-token decode, GQA
    (1, 97, 97, 2, 2, 72),  # odd lengths, odd-ish head dim
    (2, 64, 130, 4, 1, 32),  # MQA, T != S
    (1, 130, 33, 2, 2, 128),  # T > S
    (1, 40, 40, 1, 1, 256),
    (1, 17, 23, 3, 3, 5),  # tiny head dim
]

# name -> (kwargs for flash_attention-style features, kwargs for the reference)
FEATURES = {
    "plain": ({}, {}),
    "causal": ({"causal": True}, {"causal": True}),
    "causal_bottom_right": ({"causal": True, "q_offset": "bottom_right"}, {"causal": True, "bottom_right": True}),
    "window": ({"window": (7, 3)}, {"window": (7, 3)}),
    "window_causal_offset": ({"window": (5, None), "causal": True, "q_offset": 4},
                             {"window": (5, -1), "causal": True, "q_offset": 4}),
    "softcap": ({"softcap": 2.5, "scale": 0.7}, {"softcap": 2.5, "scale": 0.7}),
    "lengths": ({"lengths": True}, {"lengths": True}),
    "lengths_causal_br": ({"lengths": True, "causal": True, "q_offset": "bottom_right"},
                          {"lengths": True, "causal": True, "bottom_right": True}),
}


def _lengths(B, T, S, seed):
    rng = np.random.default_rng(seed)
    ql = rng.integers(0, T + 1, size=B).astype(np.int32)
    kl = rng.integers(0, S + 1, size=B).astype(np.int32)
    ql[0], kl[0] = T, max(S - 1, 0) if S > 1 else S  # keep one mostly-full sequence
    return jnp.asarray(ql), jnp.asarray(kl)


def run_ours(q, k, v, feat, lens):
    """jax_flash on [B, T, N, H] via vmap of the single-head core over heads (which also
    exercises the GQA fold)."""
    kw = dict(feat)
    use_lens = kw.pop("lengths", False)
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K

    def fn(q, k, v):
        # heads-major [B, N, T, H]; the kv head n // G is shared by G query heads.
        qh = jnp.swapaxes(q, 1, 2).reshape(B, K, G, T, H)
        kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        f = lambda q1, k1, v1: jax_flash.flash_attention(
            q1, k1, v1, q_lengths=lens[0] if use_lens else None,
            kv_lengths=lens[1] if use_lens else None, return_lse=True, **kw)
        # over kv heads (all operands), then over the group (q only).
        o, lse = jax.vmap(jax.vmap(f, in_axes=(1, None, None), out_axes=1), in_axes=(1, 1, 1), out_axes=1)(qh, kh, vh)
        return jnp.swapaxes(o.reshape(B, N, T, H), 1, 2), lse.reshape(B, N, T)

    return fn


def run_ref(feat, lens, dtype):
    kw = dict(feat)
    use_lens = kw.pop("lengths", False)

    def fn(q, k, v):
        return reference.attention(
            q, k, v, q_lens=lens[0] if use_lens else None, kv_lens=lens[1] if use_lens else None,
            compute_dtype=dtype, **kw)

    return fn


def _value_and_grads(fn):
    """jit(q, k, v, do -> (out, lse, (dq, dk, dv))): one compile per case."""

    def f(q, k, v, do):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        return o, lse, vjp((do.astype(o.dtype), jnp.zeros_like(lse)))

    return jax.jit(f)


def check_all(q, k, v, ours_fn, ref_fn_of_dtype, dtype, seed=0):
    do = jax.random.normal(jax.random.key(seed + 7), q.shape, jnp.float32).astype(dtype)
    o, lse, g = _value_and_grads(ours_fn)(q, k, v, do)
    o64, lse64, g64 = run_reference(_value_and_grads(ref_fn_of_dtype(jnp.float64)),
                                    *(x.astype(jnp.float64) for x in (q, k, v, do)))
    on, _, gn = run_reference(_value_and_grads(ref_fn_of_dtype(jnp.dtype(dtype))), q, k, v, do)
    assert o.dtype == q.dtype and lse.dtype == jnp.float32
    assert not jnp.isnan(o).any() and not jnp.isnan(lse).any()
    assert_flash_rule("out", o, on, o64, dtype)
    lse_scale = max(1.0, float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(lse64), lse64, 0)))))
    assert max_err(lse, lse64) <= (1e-5 if dtype == jnp.float32 else 2e-2) * lse_scale
    for name, a, b, c in zip(("dq", "dk", "dv"), g, gn, g64):
        assert a.dtype == q.dtype
        assert not jnp.isnan(a).any(), name
        assert_flash_rule(name, a, b, c, dtype)


def _check_case(shape, feature, dtype):
    B, T, S, N, K, H = shape
    q, k, v = random_qkv(zlib.crc32(repr((shape, feature)).encode()) % 1000, B, T, S, N, K, H, dtype)
    ours, refk = FEATURES[feature]
    lens = _lengths(B, T, S, seed=B * 31 + T)
    check_all(q, k, v, run_ours(q, k, v, ours, lens), lambda dt: run_ref(refk, lens, dt), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("feature", ["plain", "lengths_causal_br"])
def test_shapes(shape, feature, dtype):
    _check_case(shape, feature, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, dtype):
    _check_case((2, 61, 75, 4, 2, 40), feature, dtype)


def test_empty_rows_are_zero_with_zero_grads():
    """Rows that see no key: output 0, lse -inf, zero gradients, never NaN."""
    q, k, v = random_qkv(3, 2, 9, 12, 2, 2, 16, jnp.float32)
    kv_lens = jnp.array([0, 5], jnp.int32)  # batch 0 sees nothing at all
    f = lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, key_value_seq_lengths=kv_lens, local_window_size=(1, 0), return_residual=True)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    assert jnp.all(o[0] == 0) and jnp.all(jnp.isneginf(lse[0]))
    # batch 1: window (1, 0) over 5 keys: rows >= 6 see nothing.
    assert jnp.all(o[1, 6:] == 0) and jnp.all(jnp.isneginf(lse[1, 6:]))
    assert jnp.all(jnp.isfinite(lse[1, :6]))
    dq, dk, dv = vjp((jnp.ones_like(o), jnp.zeros_like(lse)))
    for g in (dq, dk, dv):
        assert not jnp.isnan(g).any()
    assert jnp.all(dq[0] == 0) and jnp.all(dk[0] == 0) and jnp.all(dv[0] == 0)
    assert jnp.all(dq[1, 6:] == 0) and jnp.all(dk[1, 5:] == 0)


def check_nan_propagation(dtype=jnp.float32, implementation=None):
    """NaN in, NaN out, as in jax.nn (never folded into an empty row): a NaN key reaches every
    row that sees it, a NaN query row (all its logits NaN) its own row, and their gradients;
    rows that see no NaN stay finite and match jax.nn."""
    q, k, v = random_qkv(4, 1, 5, 6, 2, 2, 64, dtype)
    k = k.at[0, 2, 0, 0].set(jnp.nan)  # head 0, key 2
    q = q.at[0, 1, 1, 0].set(jnp.nan)  # head 1, query row 1
    kv_lens = jnp.array([6], jnp.int32)
    f = lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=kv_lens, return_residual=True,
        implementation=implementation)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    xla = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    # head 0: causal rows 0, 1 do not see key 2; rows 2.. do.
    assert jnp.isfinite(out[0, :2, 0]).all() and jnp.isnan(out[0, 2:, 0]).all()
    assert jnp.isnan(xla[0, 2:, 0]).all() and jnp.isnan(lse[0, 2:, 0]).all()
    # head 1: only query row 1 is NaN.
    assert jnp.isnan(out[0, 1, 1]).all() and jnp.isnan(lse[0, 1, 1])
    rest = jnp.array([0, 2, 3, 4])
    assert jnp.isfinite(out[0, rest, 1]).all() and jnp.isfinite(lse[0, rest, 1]).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for got, want in ((out[0, :2, 0], xla[0, :2, 0]), (out[0, rest, 1], xla[0, rest, 1])):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)
    np.testing.assert_array_equal(jnp.isnan(out), jnp.isnan(xla))
    # Gradients: NaN reaches those of the rows that see it (where else a masked 0 times a NaN
    # key lands depends on which tiles a kernel skips, so only these are specified).
    dq, dk, dv = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
    assert jnp.isnan(dq[0, 2:, 0]).any(axis=-1).all() and jnp.isnan(dv[0, :, 0]).any()
    assert jnp.isnan(dq[0, 1, 1]).any()


def test_nan_inputs_propagate():
    check_nan_propagation()


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 70), S=st.integers(1, 70), K=st.integers(1, 2),
    G=st.integers(1, 3), H=st.sampled_from([1, 4, 16, 40, 64]), causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(0, 20)), right=st.one_of(st.none(), st.integers(0, 20)),
    softcap=st.one_of(st.none(), st.floats(0.5, 20)), lengths=st.booleans(),
    bottom_right=st.booleans(), seed=st.integers(0, 1000),
)
def test_hypothesis_float32(B, T, S, K, G, H, causal, left, right, softcap, lengths, bottom_right, seed):
    N = K * G
    q, k, v = random_qkv(seed, B, T, S, N, K, H, jnp.float32)
    feat = {"causal": causal, "window": (left, right), "softcap": softcap, "lengths": lengths,
            "q_offset": "bottom_right" if bottom_right else 0}
    reff = {"causal": causal, "window": (-1 if left is None else left, -1 if right is None else right),
            "softcap": softcap, "lengths": lengths, "bottom_right": bottom_right}
    lens = _lengths(B, T, S, seed)
    check_all(q, k, v, run_ours(q, k, v, feat, lens), lambda dt: run_ref(reff, lens, dt), jnp.float32, seed)


def test_no_quadratic_memory():
    """T = S = 4096: XLA's temp buffers stay far below one T x S float32 matrix (64 MiB)."""
    T = S = 4096
    q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.bfloat16)
    loss = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()
    for fn in (jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v)), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        mem = fn.lower(q, kv, kv).compile().memory_analysis()
        if mem is None:
            pytest.skip("backend reports no memory analysis")
        assert mem.temp_size_in_bytes < 8 * T * 2 * 64 * 4, mem.temp_size_in_bytes
