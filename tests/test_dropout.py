"""Attention dropout: the keep mask against an independent numpy Philox4x32-10 (uint64
arithmetic, Random123's known answers), outputs and every gradient against the float64
reference with that exact mask, rate statistics, keys, rate 0, the transforms, errors and the
GPU dispatch (lowered for CUDA from this CPU machine)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_flash
from jax_flash import reference
from conftest import assert_flash_rule, assert_vmap_matches_loop, max_err, random_qkv, vjp_fn

F32 = jnp.float32

# ------------------------------------------------------------- the numpy Philox and mask

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO32 = np.uint64(0xFFFFFFFF)


def np_philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 arrays holding uint32 values (products fit in 64 bits)."""
    c0, c1, c2, c3, k0, k1 = (np.asarray(x, np.uint64) for x in (c0, c1, c2, c3, k0, k1))
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _LO32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _LO32
        k0, k1 = (k0 + _W0) & _LO32, (k1 + _W1) & _LO32
    return c0, c1, c2, c3


def test_numpy_philox_known_answers():
    """Random123's kat_vectors for philox4x32 10 (counter, key -> output)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in np_philox4x32_10(*ctr, *key)) == want


def seed_of(rng):
    """The 64-bit Philox key the API derives from a JAX key (documented)."""
    return np.asarray(jax.random.bits(rng, (2,), jnp.uint32))


def threshold(rate):
    return min(int(np.floor(rate * 4294967296.0 + 0.5)), 0xFFFFFFFF)


def np_keep(seed, B, N, T, S, rate, broadcast=False):
    """keep[b, n, t, s]: Philox word (s % 4) of counter (s // 4, t, n, b) under key seed is
    >= round(rate * 2^32). broadcast: b = n = 0 everywhere (one mask)."""
    b, n, t, s = np.meshgrid(*(np.arange(x, dtype=np.uint64) for x in (B, N, T, S)), indexing="ij")
    if broadcast:
        b, n = 0 * b, 0 * n
    words = np.stack(np_philox4x32_10(s // np.uint64(4), t, n, b, seed[0], seed[1]))
    word = np.take_along_axis(words, (s % np.uint64(4)).astype(np.int64)[None], axis=0)[0]
    return word >= threshold(rate)


# ------------------------------------------------------------- the mask read off the kernels


def kernel_keep(B, T, S, N, K, rate, rng, **kw):
    """The kernels' keep mask [B, N, T, S] read directly: q = 0 makes P uniform (1/S) and
    v = identity (H = S) makes out[b, t, n, s] = keep / (S (1 - rate))."""
    q = jnp.zeros((B, T, N, S), F32)
    v = jnp.broadcast_to(jnp.eye(S, dtype=F32)[None, :, None, :], (B, S, K, S))
    out = jax.jit(lambda q, v, rng: jax_flash.dot_product_attention(
        q, v, v, dropout_rate=rate, dropout_rng=rng, **kw))(q, v, rng)
    scaled = np.asarray(out, np.float64).transpose(0, 2, 1, 3) * S * (1 - rate)
    keep = scaled > 0.5
    np.testing.assert_allclose(scaled, keep.astype(np.float64), atol=1e-4)  # exactly 0 or 1/(1-rate)
    return keep


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kernel_mask_is_the_philox_mask_with_the_right_rate(rate):
    """The mask equals the numpy Philox mask bit for bit (GQA: every q head its own), and the
    kept fraction over 400k elements, and over each of the 4 words of a Philox call, is within
    5 sigma of 1 - rate."""
    B, T, S, N, K = 2, 200, 256, 4, 1
    rng = jax.random.key(11)
    keep = kernel_keep(B, T, S, N, K, rate, rng)
    np.testing.assert_array_equal(keep, np_keep(seed_of(rng), B, N, T, S, rate))
    n = keep.size
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(keep.mean() - (1 - rate)) < 5 * sigma, (keep.mean(), 1 - rate)
    for r in range(4):  # each output word of a Philox call
        part = keep[..., r::4]
        assert abs(part.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / part.size)
    # Different heads of one GQA group, batch elements and rows get different masks.
    assert (keep[:, 0] != keep[:, 1]).mean() > 0.5 * 2 * rate * (1 - rate)
    assert (keep[0] != keep[1]).mean() > 0.5 * 2 * rate * (1 - rate)
    assert (keep[:, :, 0] != keep[:, :, 1]).mean() > 0.5 * 2 * rate * (1 - rate)


def test_broadcast_dropout_shares_one_mask():
    B, T, S, N = 2, 24, 40, 3
    rng = jax.random.key(3)
    keep = kernel_keep(B, T, S, N, N, 0.4, rng, broadcast_dropout=True)
    np.testing.assert_array_equal(keep, np.broadcast_to(keep[:1, :1], keep.shape))
    np.testing.assert_array_equal(keep, np_keep(seed_of(rng), B, N, T, S, 0.4, broadcast=True))


# ------------------------------------------------------------- against the float64 reference


def check_case(B, T, S, N, K, H, dtype, rate, kw, ref_kw, bias_shape=None, seed=0, broadcast=False,
               against_cpu=False):
    """jax_flash with dropout against reference.attention with the numpy Philox mask: the 2x
    rule on out, dq, dk, dv (and dbias); lse against the undropped float64 lse. Also: the
    reference with another key's mask is far off (the comparison can fail). broadcast: one mask
    for every batch element and head (broadcast_dropout). against_cpu (for the GPU): the same
    function on the CPU backend, whose keep decisions are the same, is the reference of a
    second 2x-rule check (so the two backends differ by rounding only)."""
    q, k, v = random_qkv(seed, B, T, S, N, K, H, dtype)
    bias = None if bias_shape is None else jax.random.normal(jax.random.key(seed + 1), bias_shape, F32)
    do = jax.random.normal(jax.random.key(seed + 2), q.shape, F32).astype(dtype)
    rng = jax.random.key(seed + 3)
    keep = np_keep(seed_of(rng), B, N, T, S, rate, broadcast)

    def ours(q, k, v, bias):
        o, lse = jax_flash.dot_product_attention(q, k, v, bias, return_residual=True, dropout_rate=rate,
                                                 dropout_rng=rng, broadcast_dropout=broadcast, **kw)
        return o, jnp.swapaxes(lse, 1, 2)

    def ref(dt, keep):
        return lambda q, k, v, bias: reference.attention(q, k, v, bias=bias, dropout_keep=keep, dropout_rate=rate,
                                                         compute_dtype=dt, **ref_kw)

    wb = bias is not None
    as64 = lambda *xs: (None if x is None else x.astype(jnp.float64) for x in xs)
    o, lse, g = vjp_fn(ours, wb)(q, k, v, bias, do)
    o64, lse64, g64 = vjp_fn(ref(jnp.float64, keep), wb)(*as64(q, k, v, bias, do))
    on, _, gn = vjp_fn(ref(jnp.dtype(dtype), keep), wb)(q, k, v, bias, do)
    assert o.dtype == q.dtype and not jnp.isnan(o).any()
    assert_flash_rule("out", o, on, o64, dtype)
    lse_scale = max(1.0, float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(lse64), lse64, 0)))))
    assert max_err(lse, lse64) <= (1e-5 if dtype == F32 else 2e-2) * lse_scale
    for name, a, b, c in zip(("dq", "dk", "dv", "dbias"), g, gn, g64):
        assert not jnp.isnan(a).any(), name
        assert_flash_rule(name, a, b, c, dtype)
    # Another key's mask: the same check fails by a wide margin.
    other = np_keep(seed_of(jax.random.key(seed + 100)), B, N, T, S, rate, broadcast)
    o_other, _, g_other = vjp_fn(ref(jnp.float64, other), wb)(*as64(q, k, v, bias, do))
    assert max_err(o, o_other) > 20 * max(max_err(o, o64), 1e-3)
    assert max_err(g[2], g_other[2]) > 20 * max(max_err(g[2], g64[2]), 1e-3)
    if against_cpu:
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            oc, lsec, gc = vjp_fn(ours, wb)(*(None if x is None else jax.device_put(x, cpu)
                                              for x in (q, k, v, bias, do)))
        assert max_err(lse, lsec) <= 2e-2 * lse_scale
        for name, a, b, c in zip(("out", "dq", "dk", "dv", "dbias"), (o, *g), (on, *gn), (oc, *gc)):
            assert_flash_rule(name + " vs the CPU backend", a, b, c, dtype)


# (B, T, S, N, K, H): GQA and odd lengths (not multiples of 4: partial Philox groups).
SHAPE = (2, 67, 75, 4, 2, 24)


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rate", [0.2, 0.7])
def test_forward_and_gradients_match_reference(dtype, rate):
    check_case(*SHAPE, dtype, rate, {}, {})


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_causal_gqa_lengths_with_bias_and_dbias(dtype):
    """Causal (key ranges starting off a multiple of 4), lengths, and a bias broadcast over batch
    (dbias in the separate pass) and a full one (dbias by the owning task)."""
    B, T, S, N, K, H = SHAPE
    ql, kl = jnp.array([67, 40], jnp.int32), jnp.array([75, 33], jnp.int32)
    kw = dict(is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl)
    rkw = dict(causal=True, q_lens=ql, kv_lens=kl)
    check_case(*SHAPE, dtype, 0.3, kw, rkw, bias_shape=(1, N, T, S), seed=5)
    check_case(*SHAPE, F32, 0.3, kw, rkw, bias_shape=(B, N, T, S), seed=6)


def test_segment_ids_window_softcap():
    B, T, S, N, K, H = 2, 45, 45, 2, 1, 16
    ids = jnp.sort(jax.random.randint(jax.random.key(9), (B, T), 0, 3), axis=1)
    kw = dict(query_segment_ids=ids, key_value_segment_ids=ids, local_window_size=(20, 9), softcap=3.0)
    rkw = dict(q_segment_ids=ids, kv_segment_ids=ids, window=(20, 9), softcap=3.0)
    check_case(B, T, S, N, K, H, F32, 0.25, kw, rkw, bias_shape=(B, 1, T, 1), seed=7)


def test_core_flash_attention_coordinates():
    """The core's counters: batch = the flattened leading index, head 0."""
    B, N, T, S, H = 2, 3, 21, 30, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (B, N, L, H), F32) for i, L in enumerate((T, S, S)))
    rng = jax.random.key(12)
    rate = 0.35
    keep = np_keep(seed_of(rng), B * N, 1, T, S, rate).reshape(B, N, T, S)
    ours = lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=True, dropout_rate=rate, dropout_rng=rng)

    def ref(q, k, v):
        tr = lambda x: x.reshape(B * N, 1, *x.shape[2:]).swapaxes(1, 2)  # [B*N, L, 1, H]
        o, _ = reference.attention(tr(q), tr(k), tr(v), causal=True, dropout_keep=keep.reshape(B * N, 1, T, S),
                                   dropout_rate=rate)
        return o.swapaxes(1, 2).reshape(B, N, T, H)

    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(loss(f), argnums=(0, 1, 2)))(*xs) for f, xs in (
        (ours, (q, k, v)), (ref, tuple(x.astype(jnp.float64) for x in (q, k, v)))))
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------- keys and rate 0


def _qkv(seed=0, B=2, T=33, S=37, N=4, K=2, H=16, dtype=F32):
    return random_qkv(seed, B, T, S, N, K, H, dtype)


def test_same_key_same_output_different_key_different():
    q, k, v = _qkv()
    f = lambda rng: jax_flash.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng)
    a, b = f(jax.random.key(1)), jax.jit(f)(jax.random.key(1))
    np.testing.assert_array_equal(a, b)  # eager and jit, one key: the same bits
    c = f(jax.random.key(2))
    assert float(jnp.abs(a - c).max()) > 0.1
    # A raw uint32[2] key (jax.random.PRNGKey) gives what the typed key with the same data gives.
    np.testing.assert_array_equal(f(jax.random.PRNGKey(1)), a)
    # The backward recomputes the same mask: gradients are deterministic per key too.
    g = lambda rng: jax.grad(lambda q: jnp.sum(jax_flash.dot_product_attention(
        q, k, v, dropout_rate=0.5, dropout_rng=rng) ** 2))(q)
    np.testing.assert_array_equal(g(jax.random.key(1)), g(jax.random.key(1)))
    assert float(jnp.abs(g(jax.random.key(1)) - g(jax.random.key(2))).max()) > 1e-2


def _primitive_specs(jaxpr):
    """The `spec` params of every jax_flash primitive in a jaxpr, nested ones included."""
    out = []
    for e in jaxpr.eqns:
        if "spec" in e.params:
            out.append(e.params["spec"])
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):  # cond's branches are a tuple
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _primitive_specs(sub)
    return out


def test_rate_zero_is_exactly_no_dropout():
    q, k, v = _qkv(1)
    bias = jax.random.normal(jax.random.key(4), (1, 4, 33, 37), F32)
    base = lambda q, k, v, b: jax_flash.dot_product_attention(q, k, v, b, is_causal=True)
    for kw in (dict(dropout_rate=0.0), dict(dropout_rate=0.0, dropout_rng=jax.random.key(0)), dict(dropout_rate=0)):
        f = lambda q, k, v, b: jax_flash.dot_product_attention(q, k, v, b, is_causal=True, **kw)
        np.testing.assert_array_equal(f(q, k, v, bias), base(q, k, v, bias))
        loss = lambda fn: lambda *a: jnp.sum(fn(*a) ** 2)
        for a, b in zip(jax.grad(loss(f), argnums=(0, 1, 2, 3))(q, k, v, bias),
                        jax.grad(loss(base), argnums=(0, 1, 2, 3))(q, k, v, bias)):
            np.testing.assert_array_equal(a, b)
        # No dropout operand reaches the primitive.
        specs = _primitive_specs(jax.make_jaxpr(f)(q, k, v, bias).jaxpr)
        assert specs and all("dropout" not in s.extras and s.dropout_rate == 0.0 for s in specs)


def test_expectation_over_keys_is_the_undropped_output():
    """Inverted dropout is unbiased: the mean over many keys approaches the output without it."""
    q, k, v = _qkv(2, B=1, T=8, S=16, N=2, K=2, H=8)
    f = jax.jit(jax.vmap(lambda rng: jax_flash.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng)))
    mean = f(jax.random.split(jax.random.key(0), 4000)).mean(0)
    want = jax_flash.dot_product_attention(q, k, v)
    assert float(jnp.abs(mean - want).max()) < 0.1
    assert float(jnp.abs(f(jax.random.split(jax.random.key(0), 1))[0] - want).max()) > 0.3


# ------------------------------------------------------------------------ transforms


def core(q, k, v, rng, rate=0.4):
    return jax_flash.flash_attention(q, k, v, causal=True, dropout_rate=rate, dropout_rng=rng)


def _core_args(seed, V=3, T=19, S=23, H=8):
    q, k, v = (jax.random.normal(jax.random.key(seed + i), (V, L, H), F32) for i, L in enumerate((T, S, S)))
    return q, k, v, jax.random.split(jax.random.key(seed + 3), V)


@pytest.mark.parametrize("in_axes", [
    (0, 0, 0, 0),  # everything mapped, one key per example: the batch fold
    (0, None, None, 0),  # q alone, a key each: the GQA-group fold maps the key table
    (0, None, None, None),  # q alone, one shared key: every example the unbatched call's mask
    (0, 0, 0, None),  # shared key, batch fold
], ids=["all", "q_only_keys", "q_only_shared_key", "shared_key"])
def test_vmap_matches_loop(in_axes):
    assert_vmap_matches_loop(core, _core_args(20), in_axes)


def test_vmapped_keys_give_each_example_its_own_mask():
    """The same q/k/v under vmap with 3 keys: 3 different outputs, each the unbatched one."""
    q, k, v, keys = _core_args(30)
    q, k, v = q[0], k[0], v[0]
    got = jax.vmap(lambda rng: core(q, k, v, rng))(keys)
    for j in range(3):
        np.testing.assert_array_equal(got[j], core(q, k, v, keys[j]))
    assert float(jnp.abs(got[0] - got[1]).max()) > 0.1
    # The same key under vmap: identical outputs (vmap of a call with one key, like a loop).
    same = jax.vmap(lambda q: core(q, k, v, keys[0]))(jnp.stack([q, q]))
    np.testing.assert_array_equal(same[0], same[1])


def test_vmap_over_heads_axis_with_keys():
    """vmap next to heads (the heads fold) with a key per example, forward and grad."""
    q, k, v = _qkv(31, B=2, T=9, S=12, N=4, K=2, H=16)
    keys = jax.random.split(jax.random.key(5), 3)
    scales = (1, 2, -1)
    stack = lambda x: jnp.stack([s * x for s in scales], axis=2)
    f = lambda q, k, v, rng: jax_flash.dot_product_attention(q, k, v, is_causal=True, dropout_rate=0.3,
                                                             dropout_rng=rng)
    loss = lambda q, k, v, rng: jnp.sum(f(q, k, v, rng) ** 2)
    got = jax.jit(jax.vmap(f, in_axes=(2, 2, 2, 0), out_axes=2))(stack(q), stack(k), stack(v), keys)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(2, 2, 2, 0)))(
        stack(q), stack(k), stack(v), keys)
    for j, s in enumerate(scales):
        np.testing.assert_allclose(got[:, :, j], f(s * q, s * k, s * v, keys[j]), rtol=1e-5, atol=1e-5)
        for a, w in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(s * q, s * k, s * v, keys[j])):
            np.testing.assert_allclose(a[j], w, rtol=2e-4, atol=2e-4)


def test_vmap_of_grad_and_grad_of_vmap_with_bias():
    q, k, v, keys = _core_args(40)
    bias = jax.random.normal(jax.random.key(41), (19, 23), F32)
    loss = lambda q, k, v, b, rng: jnp.sum(jax_flash.flash_attention(
        q, k, v, bias=b, dropout_rate=0.3, dropout_rng=rng) ** 2)
    g = jax.grad(loss, argnums=(0, 1, 2, 3))
    got = jax.jit(jax.vmap(g, in_axes=(0, 0, 0, None, 0)))(q, k, v, bias, keys)
    for j in range(3):
        for a, w in zip(got, g(q[j], k[j], v[j], bias, keys[j])):
            np.testing.assert_allclose(a[j], w, rtol=1e-4, atol=1e-5)
    total = jax.grad(lambda b: jnp.sum(jax.vmap(loss, in_axes=(0, 0, 0, None, 0))(q, k, v, b, keys)))(bias)
    np.testing.assert_allclose(total, got[3].sum(0), rtol=1e-4, atol=1e-4)
    # q alone mapped, a key each: the forward takes the GQA-group fold, the backward the batch
    # fold; both must fold the key table alike.
    got = jax.jit(jax.vmap(g, in_axes=(0, None, None, None, 0)))(q, k[0], v[0], bias, keys)
    for j in range(3):
        for a, w in zip(got, g(q[j], k[0], v[0], bias, keys[j])):
            np.testing.assert_allclose(a[j], w, rtol=1e-4, atol=1e-5)


def test_sharded_batch_and_heads_match_one_device():
    """The key table shards with batch and heads and carries global coordinates: the sharded
    computation drops exactly what the single-device one does."""
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 host devices")
    q, k, v = _qkv(50, B=4, T=16, S=16, N=4, K=2, H=8)
    rng = jax.random.key(7)
    loss = lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(
        q, k, v, is_causal=True, dropout_rate=0.5, dropout_rng=rng) ** 2)
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    want = grad(q, k, v)
    mesh = jax.make_mesh((2, 2), ("d", "h"), devices=jax.devices("cpu")[:4])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d", None, "h")))
    with jax.set_mesh(mesh):
        got = jax.jit(grad)(put(q), put(k), put(v))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dropout_rate=0.1), ValueError, "dropout_rate > 0 requires dropout_rng"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, r"dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)), ValueError, r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=float("nan"), dropout_rng=jax.random.key(0)), ValueError, r"dropout_rate must be in \[0, 1\)"),
    (dict(dropout_rate=jnp.float32(0.1), dropout_rng=jax.random.key(0)), TypeError, "dropout_rate must be a Python float"),
    (dict(dropout_rate="0.1", dropout_rng=jax.random.key(0)), TypeError, "dropout_rate must be a Python float"),
    (dict(dropout_rate=True, dropout_rng=jax.random.key(0)), TypeError, "dropout_rate must be a Python float"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.uint32)), TypeError, "dropout_rng must be a JAX PRNG key"),
    (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((2,), jnp.int32)), TypeError, "dropout_rng must be a JAX PRNG key"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0), 2)), ValueError,
     "dropout_rng must be a single PRNG key"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), broadcast_dropout=1), TypeError,
     "broadcast_dropout must be a bool"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="xla"), ValueError,
     "dropout_rate > 0 is not supported by implementation='xla'"),
])
def test_argument_errors(kw, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, **kw)).lower(q, k, v)


def test_traced_rate_is_an_error_and_core_checks_too():
    x = jnp.zeros((2, 8, 16), F32)
    with pytest.raises(TypeError, match="dropout_rate must be a Python float"):
        jax.jit(lambda r: jax_flash.flash_attention(x, x, x, dropout_rate=r, dropout_rng=jax.random.key(0)))(0.1)
    with pytest.raises(ValueError, match="dropout_rate > 0 requires dropout_rng"):
        jax_flash.flash_attention(x, x, x, dropout_rate=0.5)


# ------------------------------------------------------------------------ GPU dispatch


def _cuda_custom_calls(fn, *args):
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=jax_flash.export_disabled_checks())(*args)
    return re.findall(r"custom_call @(\w+)", exp.mlir_module())


def test_gpu_lowering_takes_the_portable_kernels():
    """Lowered for CUDA, dropout runs in jax_flash's kernels, forward and backward, with or
    without a bias (the CUDA handler sends any call with dropout to the portable kernels, also on
    Hopper); implementation="hopper" with dropout is an error at lowering, naming it."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    rng = jax.random.key(0)
    bias = jnp.zeros((1, 4, 33, 37), F32)
    for b in (None, bias):
        f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, b, dropout_rate=0.1, dropout_rng=rng)
        assert _cuda_custom_calls(f, q, k, v) == ["jax_flash_fwd"]
        loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(F32))
        assert sorted(_cuda_custom_calls(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)) == ["jax_flash_bwd",
                                                                                         "jax_flash_fwd"]
    core = lambda q: jax_flash.flash_attention(q, q, q, causal=True, dropout_rate=0.1, dropout_rng=rng)
    assert _cuda_custom_calls(core, q[:, :, 0]) == ["jax_flash_fwd"]
    with pytest.raises(ValueError, match="kernel='hopper' does not take dropout"):
        _cuda_custom_calls(lambda q, k, v: jax_flash.dot_product_attention(
            q, k, v, dropout_rate=0.1, dropout_rng=rng, implementation="hopper"), q, k, v)
    # Rate 0 lowers to the GPU kernels as before (no dropout operand: Hopper stays eligible).
    assert _cuda_custom_calls(lambda q, k, v: jax_flash.dot_product_attention(
        q, k, v, dropout_rate=0.0, dropout_rng=rng, implementation="hopper"), q, k, v) == ["jax_flash_fwd"]
