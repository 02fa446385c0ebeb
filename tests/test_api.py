"""The public API: parity with jax.nn.dot_product_attention (implementation="xla") where its
semantics are defined, layouts, and the trace-time error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import random_qkv


def xla(*args, **kw):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kw)


PARITY = [
    dict(),
    dict(is_causal=True),
    dict(local_window_size=(5, 2)),
    dict(local_window_size=3, is_causal=True),
    dict(scale=0.3),
    dict(query_seq_lengths=jnp.array([7, 19], jnp.int32), key_value_seq_lengths=jnp.array([23, 5], jnp.int32)),
    dict(is_causal=True, key_value_seq_lengths=jnp.array([23, 20], jnp.int32)),
]


@pytest.mark.parametrize("kw", PARITY, ids=lambda kw: ",".join(kw) or "plain")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_parity_with_jax_nn(kw, heads):
    N, K = heads
    q, k, v = random_qkv(1, 2, 19, 23, N, K, 32, jnp.float32)
    do = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    ours, vjp_ours = jax.vjp(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, **kw), q, k, v)
    ref, vjp_ref = jax.vjp(lambda q, k, v: xla(q, k, v, **kw), q, k, v)
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=2e-5)
    for a, b in zip(vjp_ours(do), vjp_ref(do)):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5)


def test_parity_residual_and_unbatched_layout():
    q, k, v = random_qkv(2, 1, 12, 17, 4, 2, 16, jnp.float32)
    o, lse = jax_flash.dot_product_attention(q[0], k[0], v[0], is_causal=True, return_residual=True)
    o_ref, lse_ref = xla(q[0], k[0], v[0], is_causal=True, return_residual=True)
    assert o.shape == (12, 4, 16) and lse.shape == (12, 4) and lse.dtype == jnp.float32
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, atol=2e-5)


def test_bf16_output_dtype_and_default_scale():
    q, k, v = random_qkv(3, 2, 8, 8, 2, 2, 64, jnp.bfloat16)
    out = jax_flash.dot_product_attention(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    ref = xla(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


def test_implementation_xla_delegates_to_jax_nn():
    q, k, v = random_qkv(4, 1, 8, 8, 2, 2, 16, jnp.float32)
    np.testing.assert_array_equal(jax_flash.dot_product_attention(q, k, v, implementation="xla"), xla(q, k, v))


def test_core_matches_dropin_and_bottom_right_decode():
    """flash_attention on [..., T, H] equals the drop-in per head; bottom-right alignment puts
    the last query at the last key (KV-cache decoding)."""
    q, k, v = random_qkv(5, 1, 3, 10, 1, 1, 16, jnp.float32)
    core = jax_flash.flash_attention(q[0, :, 0], k[0, :, 0], v[0, :, 0], causal=True, q_offset="bottom_right")
    # Query row i sits at key position i + 7: same as the top-left mask over the last rows
    # of a 10-query problem.
    q_full = jnp.concatenate([jnp.zeros((1, 7, 1, 16), q.dtype), q], axis=1)
    full = xla(q_full, k, v, is_causal=True)[0, 7:, 0]
    np.testing.assert_allclose(core, full, atol=2e-6)


# ----------------------------------------------------------------------------- errors


def _qkv(T=8, S=8, N=4, K=2, H=16, dtype=jnp.float32):
    return random_qkv(0, 2, T, S, N, K, H, dtype)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda q, k, v: (q[0, 0], k, v), ValueError, "query must be"),
        (lambda q, k, v: (q, k[0], v), ValueError, "key must have query's rank"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, "value must have key's shape"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "key must be"),
        (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), TypeError, "query, key, value must share one dtype"),
        (lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), TypeError, "query must be bfloat16"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v: (jnp.zeros((2, 8, 4, 300), jnp.float32), jnp.zeros((2, 8, 2, 300), jnp.float32), jnp.zeros((2, 8, 2, 300), jnp.float32)), ValueError, "head dim"),
        (lambda q, k, v: (q[:, :0], k, v), ValueError, "sequence length T >= 1"),
        (lambda q, k, v: (q[:, :, :0], k[:, :, :0], v[:, :, :0]), ValueError, "heads N >= 1"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "heads K >= 1"),
    ],
)
def test_shape_and_dtype_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        jax_flash.dot_product_attention(*make(*_qkv()))


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(query_seq_lengths=jnp.array([1, 2, 3], jnp.int32)), ValueError, r"query_seq_lengths must have shape \(2,\)"),
        (dict(key_value_seq_lengths=jnp.array([1.0, 2.0])), TypeError, "key_value_seq_lengths must be an integer array"),
        (dict(local_window_size=(-1, 2)), ValueError, "local_window_size left size must be >= 0"),
        (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size must be an int or a"),
        (dict(local_window_size=(1.5, 2)), TypeError, "local_window_size left size must be an int"),
        (dict(scale=jnp.float32(0.5)), TypeError, "scale must be a Python or NumPy real number"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(softcap=-1.0), ValueError, "softcap must be positive"),
        (dict(implementation="magic"), ValueError, "implementation must be"),
        (dict(bias=jnp.zeros((2, 3, 8, 8))), ValueError, r"bias of shape \(2, 3, 8, 8\) is not broadcastable"),
        # Flags are static bools: a truthy string must not quietly mean True.
        (dict(is_causal="no"), TypeError, "is_causal must be a bool"),
        (dict(return_residual=1), TypeError, "return_residual must be a bool"),
    ],
)
def test_argument_errors(kw, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        jax_flash.dot_product_attention(q, k, v, **kw)


def check_empty_batch(dtype=jnp.float32, kernel=None):
    """batch = 0 is a valid, empty problem: empty outputs and gradients, and a bias broadcast over
    the batch gets a zero gradient (the kernels launch nothing)."""
    q, k, v = (x[:0] for x in random_qkv(0, 1, 8, 8, 4, 2, 64, dtype))
    bias = jax.random.normal(jax.random.key(1), (1, 4, 8, 8), jnp.float32)

    def loss(q, k, v, bias):
        o = jax_flash.dot_product_attention(q, k, v, bias, is_causal=True, implementation=kernel)
        return o.astype(jnp.float32).sum()

    out = jax_flash.dot_product_attention(q, k, v, is_causal=True, implementation=kernel)
    assert out.shape == q.shape and out.dtype == q.dtype
    dq, dk, dv, dbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_array_equal(np.asarray(dbias), np.zeros(bias.shape, np.float32))


def test_empty_batch():
    check_empty_batch()


def test_errors_raise_at_trace_time():
    """Errors come from tracing (jit never reaches a kernel)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jax.jit(jax_flash.dot_product_attention).lower(q[:, :, :3], k, v)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(q_offset="top_left"), ValueError, "q_offset must be an int or 'bottom_right'"),
        (dict(q_offset=1.5), TypeError, "q_offset must be an int"),
        (dict(window=(2, -3)), ValueError, "window right size must be >= 0"),
        (dict(kernel="fast"), ValueError, "kernel must be one of"),
        (dict(q_lengths=jnp.array([3], jnp.int32)), ValueError, r"q_lengths must have shape \(2,\)"),
        (dict(deterministic=1), TypeError, "deterministic must be a bool"),
        (dict(causal="no"), TypeError, "causal must be a bool"),
        (dict(causal=jnp.bool_(True)), TypeError, "causal must be a bool"),
        (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    ],
)
def test_core_argument_errors(kw, exc, match):
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8, 16), jnp.float32) for i in range(3))
    with pytest.raises(exc, match=match):
        jax_flash.flash_attention(q, k, v, **kw)


def test_core_shape_errors():
    z = lambda *s: jnp.zeros(s, jnp.float32)
    with pytest.raises(ValueError, match="q, k, v must share leading dims"):
        jax_flash.flash_attention(z(2, 8, 16), z(3, 8, 16), z(3, 8, 16))
    with pytest.raises(ValueError, match="k head dim must equal q's"):
        jax_flash.flash_attention(z(2, 8, 16), z(2, 8, 8), z(2, 8, 8))
    with pytest.raises(ValueError, match="q must have rank >= 2"):
        jax_flash.flash_attention(z(16), z(8, 16), z(8, 16))


_LOG_SCRIPT = """
import jax, jax.numpy as jnp, jax_flash
q = k = v = jnp.ones((1, 16, 2, 32), jnp.float32)
bias = jnp.zeros((16, 16), jnp.float32)
f = lambda q, k, v, b: jnp.sum(jax_flash.dot_product_attention(q, k, v, b, is_causal=True))
jax.block_until_ready(jax.grad(f, argnums=(0, 3))(q, k, v, bias))
"""


@pytest.mark.parametrize("env", ["1", "0"])
def test_kernel_log_names_the_kernels_that_ran(env, tmp_path):
    """JAX_FLASH_LOG_KERNELS=1 prints one stderr line per launch of the handlers: the pass, the
    kernels (cpu here; hopper or portable on a GPU, test_gpu.py checks the routing with it), the
    head dim and the optional inputs. Unset or 0: silent."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _LOG_SCRIPT], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_FLASH_LOG_KERNELS=env, JAX_PLATFORMS="cpu"),
                         cwd=tmp_path)  # the installed package, not the source tree's jax_flash/
    assert run.returncode == 0, run.stderr[-3000:]
    log = sorted({line for line in run.stderr.splitlines() if line.startswith("jax_flash: ")})
    expected = ["jax_flash: backward cpu head_dim=32 bias", "jax_flash: forward cpu head_dim=32 bias"]
    assert log == (expected if env == "1" else []), log
