"""Every JAX transform over jax_flash: jit, vmap (any axis, any subset, nested), vmap of
grad, grad of vmap, jacrev, checkpoint, export; and HLO checks that vmapped axes fold into
the kernel's batch/head dimension without copies or broadcasts of k/v."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import reference
from conftest import random_qkv

F32 = jnp.float32


def core(q, k, v, **kw):
    return jax_flash.flash_attention(q, k, v, causal=True, **kw)


def core_loop(q, k, v):
    """The same single-head call per leading index, no vmap."""
    return jnp.stack([core(q[i], k[i], v[i]) for i in range(q.shape[0])])


def rand(shape, seed, dtype=F32):
    return jax.random.normal(jax.random.key(seed), shape, F32).astype(dtype)


def compiled_hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_jit_matches_eager():
    q, k, v = rand((13, 16), 0), rand((20, 16), 1), rand((20, 16), 2)
    np.testing.assert_allclose(jax.jit(core)(q, k, v), core(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (1, 1, 1), (2, 2, 2), (0, 1, 2), (1, None, None), (None, 0, 0), (0, None, 0)])
def test_vmap_any_axis_any_subset(in_axes):
    """vmap over an extra axis placed anywhere, of any subset of q/k/v."""
    Vn, T, S, H = 3, 11, 14, 8
    base = {"q": (T, H), "k": (S, H), "v": (S, H)}
    args = []
    for i, (name, shp) in enumerate(base.items()):
        ax = in_axes[i]
        shp = list(shp)
        if ax is not None:
            shp.insert(ax, Vn)
        args.append(rand(tuple(shp), i))
    got = jax.vmap(core, in_axes=in_axes)(*args)
    for j in range(Vn):
        sl = [a if ax is None else jnp.take(a, j, axis=ax) for a, ax in zip(args, in_axes)]
        np.testing.assert_allclose(got[j], core(*sl), rtol=1e-6, atol=1e-6)


def test_nested_vmap_equals_leading_dims():
    q, k, v = rand((2, 3, 9, 16), 0), rand((2, 3, 12, 16), 1), rand((2, 3, 12, 16), 2)
    nested = jax.vmap(jax.vmap(core))(q, k, v)
    np.testing.assert_allclose(nested, core(q, k, v), rtol=1e-6, atol=1e-6)


def test_vmap_dot_product_attention_extra_axis():
    q, k, v = random_qkv(0, 2, 9, 12, 4, 2, 16, F32)
    stack = lambda x: jnp.stack([x, 2 * x, -x])
    for axis in (0, 2):  # in front of batch, and next to heads
        qs, ks, vs = (jnp.moveaxis(stack(x), 0, axis) for x in (q, k, v))
        got = jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True),
                       in_axes=axis, out_axes=axis)(qs, ks, vs)
        for j, s in enumerate((1, 2, -1)):
            want = jax_flash.dot_product_attention(s * q, s * k, s * v, is_causal=True)
            np.testing.assert_allclose(jnp.take(got, j, axis=axis), want, rtol=1e-5, atol=1e-5)


def test_vmap_of_grad_with_shared_kv():
    """Per-example gradients with k/v shared (cuDNN can, FA3's binding cannot)."""
    q, k, v = rand((4, 10, 16), 0), rand((12, 16), 1), rand((12, 16), 2)
    loss = lambda q, k, v: jnp.sum(core(q, k, v) ** 2)
    per_ex = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None))(q, k, v)
    for i in range(4):
        want = jax.grad(loss, argnums=(0, 1, 2))(q[i], k, v)
        for a, b in zip(per_ex, want):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-5)


def test_grad_of_vmap_matches_loop():
    q, k, v = rand((3, 10, 16), 0), rand((3, 12, 16), 1), rand((3, 12, 16), 2)
    f = lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(core)(q, k, v)))
    g = lambda q, k, v: jnp.sum(jnp.sin(core_loop(q, k, v)))
    for a, b in zip(jax.grad(f, (0, 1, 2))(q, k, v), jax.grad(g, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_vmap_q_only_grads_sum_over_mapped_axis():
    """Mapping q alone folds into GQA groups: dk/dv must sum over the mapped axis."""
    q, k, v = rand((5, 7, 8), 0), rand((9, 8), 1), rand((9, 8), 2)
    f = lambda q, k, v: jnp.sum(jax.vmap(core, in_axes=(0, None, None))(q, k, v) ** 2)
    g = lambda q, k, v: sum(jnp.sum(core(q[i], k, v) ** 2) for i in range(5))
    for a, b in zip(jax.grad(f, (0, 1, 2))(q, k, v), jax.grad(g, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_vmap_over_an_empty_axis():
    """A mapped axis of size 0 (core and drop-in, forward and gradients, a bias shared by every
    example): empty results of the right shapes, no kernel launched."""
    core = jax.vmap(lambda q: jax_flash.flash_attention(q, q, q, causal=True))
    assert core(jnp.ones((0, 16, 64), jnp.float32)).shape == (0, 16, 64)
    g = jax.vmap(jax.grad(lambda q: jax_flash.flash_attention(q, q, q, causal=True).sum()))
    assert g(jnp.ones((0, 16, 64), jnp.float32)).shape == (0, 16, 64)
    bias = jnp.ones((1, 2, 8, 8), jnp.float32)

    def loss(q, b):
        return jax_flash.dot_product_attention(q, q, q, b).sum()

    for in_axis, q in ((0, jnp.ones((0, 1, 8, 2, 16), jnp.float32)), (1, jnp.ones((1, 0, 8, 2, 16), jnp.float32))):
        dq, db = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(in_axis, None))(q, bias)
        assert dq.shape == (0, 1, 8, 2, 16) and db.shape == (0, 1, 2, 8, 8)


def test_second_order_is_a_clear_error():
    """grad of grad (hessian) is not supported: a NotImplementedError that says what is."""
    q, k, v = random_qkv(5, 1, 6, 6, 2, 2, 8, jnp.float32)
    f = lambda q: jax_flash.dot_product_attention(q, k, v, is_causal=True).sum()
    with pytest.raises(NotImplementedError, match="only first-order reverse-mode"):
        jax.grad(lambda q: jax.grad(f)(q).sum())(q)


def test_jacrev_matches_reference():
    q, k, v = rand((1, 5, 1, 4), 0, jnp.float64), rand((1, 6, 1, 4), 1, jnp.float64), rand((1, 6, 1, 4), 2, jnp.float64)
    q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
    ours = jax.jacrev(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True), argnums=(0, 1, 2))(q32, k32, v32)
    ref = jax.jacrev(lambda q, k, v: reference.attention(q, k, v, causal=True)[0], argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_checkpoint_remat():
    q, k, v = rand((2, 10, 16), 0), rand((2, 12, 16), 1), rand((2, 12, 16), 2)
    f = lambda q, k, v: jnp.sum(jnp.tanh(core(q, k, v)))
    a = jax.grad(jax.checkpoint(f), (0, 1, 2))(q, k, v)
    b = jax.grad(f, (0, 1, 2))(q, k, v)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    # remat really recomputes the forward custom call in the backward pass.
    hlo = jax.jit(jax.value_and_grad(jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable))).lower(q, k, v).as_text()
    assert hlo.count("@jax_flash_fwd") == 2 and hlo.count("@jax_flash_bwd") == 1


def test_export_roundtrip_with_vjp():
    from jax import export

    q, k, v = random_qkv(1, 2, 9, 11, 4, 2, 16, jnp.bfloat16)
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True))
    # The CPU backend's kernels (the test's device, also on a GPU machine).
    exp = export.export(f, platforms=["cpu"], disabled_checks=jax_flash.export_disabled_checks())(q, k, v)
    blob = exp.serialize(vjp_order=1)
    exp2 = export.deserialize(blob)
    np.testing.assert_array_equal(np.asarray(exp2.call(q, k, v), np.float32), np.asarray(f(q, k, v), np.float32))
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v).astype(F32) ** 2)
    for a, b in zip(jax.grad(loss(exp2.call), (0, 1, 2))(q, k, v), jax.grad(loss(f), (0, 1, 2))(q, k, v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_export_without_disabled_checks_fails_clearly():
    from jax import export

    q, k, v = random_qkv(1, 1, 4, 4, 1, 1, 8, jnp.bfloat16)
    with pytest.raises(ValueError, match="jax_flash_fwd"):
        export.export(jax.jit(jax_flash.dot_product_attention))(q, k, v)


# ------------------------------------------------------------------------ HLO checks


@pytest.mark.parametrize("axis", [0, 2])
def test_hlo_vmap_next_to_batch_or_heads_is_free(axis):
    """A vmapped axis in front of batch or next to heads is a bitcast, not a copy."""
    q, k, v = random_qkv(0, 2, 16, 24, 4, 2, 32, jnp.bfloat16)
    qs, ks, vs = (jnp.stack([x] * 3, axis=axis) for x in (q, k, v))
    fwd = jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True), in_axes=axis, out_axes=axis)
    loss = lambda q, k, v: jnp.sum(fwd(q, k, v).astype(F32))
    for fn in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
        hlo = compiled_hlo(fn, qs, ks, vs)
        assert "custom_call_target=\"jax_flash_" in hlo
        assert not re.search(r" (transpose|copy)\(%", hlo), hlo


def test_hlo_vmap_q_only_never_broadcasts_kv():
    """Forward with q mapped and k/v shared: k/v reach the kernel as they are (GQA fold)."""
    q, k, v = random_qkv(0, 2, 16, 24, 4, 2, 32, jnp.bfloat16)
    qs = jnp.stack([q] * 3)
    fwd = jax.vmap(lambda q, k, v: jax_flash.dot_product_attention(q, k, v), in_axes=(0, None, None))
    hlo = compiled_hlo(fwd, qs, k, v)
    assert not re.search(r" broadcast\(%", hlo), hlo
    calls = [line for line in hlo.splitlines() if "custom-call(" in line]
    assert len(calls) == 1 and "bf16[2,24,2,32]" in calls[0] and "bf16[2,16,12,32]" in calls[0], calls
