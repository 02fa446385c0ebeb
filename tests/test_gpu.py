"""The GPU kernels (Hopper and portable paths) against the float64 reference under
FlashAttention's 2x rule, transforms on the GPU, long context and memory; segment ids, bias
(dbias) and boolean masks against the reference and the CPU backend. Skipped (visibly)
without a GPU."""

import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from conftest import random_qkv
from test_features import check_case, dropin, packed_ids, rand_bias, rand_mask, ref_of
from test_numerics import FEATURES, _lengths, check_all, run_ours, run_ref

pytestmark = pytest.mark.gpu

GPU_DTYPES = [jnp.bfloat16, jnp.float16]
KERNELS = ["auto", "portable"]

# (B, T, S, N, K, H)
GPU_SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 1, 333, 8, 2, 128),  # decode, GQA 4:1
    (1, 97, 97, 2, 2, 64),  # odd lengths
    (2, 128, 300, 4, 1, 32),  # MQA, T != S
    (1, 513, 129, 2, 2, 72),  # T > S, odd head dim (Hopper: padded to 128)
    (1, 200, 1000, 2, 2, 96),
    (1, 333, 257, 2, 1, 160),  # Hopper: forward padded to 256, backward portable (192-wide dq_accum)
    (2, 190, 300, 4, 2, 200),  # Hopper: both passes padded to 256
    (1, 256, 384, 2, 2, 256),
    (1, 2048, 2048, 4, 2, 128),
    (1, 8192, 8192, 2, 1, 128),
]


def _case(shape, feature, dtype, kernel):
    B, T, S, N, K, H = shape
    q, k, v = random_qkv(zlib.crc32(repr((shape, feature)).encode()) % 1000, B, T, S, N, K, H, dtype)
    ours, refk = FEATURES[feature]
    ours = dict(ours, kernel=kernel)
    lens = _lengths(B, T, S, seed=B * 31 + T)
    check_all(q, k, v, run_ours(q, k, v, ours, lens), lambda dt: run_ref(refk, lens, dt), dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("feature", ["plain", "lengths_causal_br"])
def test_gpu_shapes(shape, feature, dtype, kernel):
    _case(shape, feature, dtype, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("H", [64, 128, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gpu_features(feature, H, dtype, kernel):
    _case((2, 300, 450, 4, 2, H), feature, dtype, kernel)


def test_gpu_matches_cpu_backend():
    """Same function on both backends (within bf16 rounding of the output)."""
    q, k, v = random_qkv(5, 2, 190, 211, 4, 2, 64, jnp.bfloat16)
    f = lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True, local_window_size=(50, 10), softcap=5.0)
    gpu = np.asarray(jax.jit(f)(q, k, v), np.float32)
    cpu_dev = jax.devices("cpu")[0]
    cpu = np.asarray(jax.jit(f)(*(jax.device_put(x, cpu_dev) for x in (q, k, v))), np.float32)
    np.testing.assert_allclose(gpu, cpu, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("H", [64, 128, 256])
def test_gpu_deterministic_backward_is_bitwise_stable(H, kernel):
    # Hopper (auto on an H200; 256 is the head-dim-split kernel) and portable deterministic backwards:
    # correct under the 2x rule and bit-identical over repeated runs.
    B, T, S, N, K = 2, 700, 900, 4, 2
    q, k, v = random_qkv(6 + H, B, T, S, N, K, H, jnp.bfloat16)
    lens = _lengths(B, T, S, seed=7)
    ours, refk = FEATURES["lengths_causal_br"]
    ours = dict(ours, deterministic=True, kernel=kernel)
    check_all(q, k, v, run_ours(q, k, v, ours, lens), lambda dt: run_ref(refk, lens, dt), jnp.bfloat16)
    fn = run_ours(q, k, v, ours, lens)  # GQA through the vmap fold
    loss = lambda q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32) ** 2)
    g = jax.jit(jax.grad(loss, (0, 1, 2)))
    first = g(q, k, v)
    for _ in range(3):
        for x, y in zip(first, g(q, k, v)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_gpu_vmap_of_grad_and_export():
    from jax import export

    q, k, v = random_qkv(7, 3, 64, 80, 4, 2, 64, jnp.bfloat16)
    # per-example gradients of [T, N, H] queries against one shared [S, K, H] key/value set
    loss = lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
    per_ex = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None, None)))(q, k[0], v[0])
    for i in range(3):
        want = jax.grad(loss)(q[i], k[0], v[0])
        np.testing.assert_allclose(np.asarray(per_ex[i], np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True))
    exp = export.deserialize(export.export(f, disabled_checks=jax_flash.export_disabled_checks())(q, k, v).serialize())
    np.testing.assert_array_equal(np.asarray(exp.call(q, k, v), np.float32), np.asarray(f(q, k, v), np.float32))


def test_gpu_float32_is_a_clear_error():
    q, k, v = random_qkv(0, 1, 8, 8, 1, 1, 64, jnp.float32)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        jax.jit(jax_flash.dot_product_attention)(q, k, v)


_LONG = r"""
import jax, jax.numpy as jnp, jax_flash
S, N, H = 131072, 16, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(x, (1, S, N, H), jnp.bfloat16) for x in ks)
f = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, is_causal=True), q, k, v)[1](do))
dq, dk, dv = jax.block_until_ready(f(q, k, v, do))
assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (dq, dk, dv))
stats = jax.devices()[0].memory_stats()
io = 4 * q.nbytes + 3 * q.nbytes  # q, k, v, do in; dq, dk, dv out
print("PEAK", stats["peak_bytes_in_use"], "IO", io)
"""


def test_gpu_long_context_memory():
    """fwd+bwd causal at S = 131072, N = 16, H = 128: peak memory within a small constant
    of inputs + outputs (no S x S anything)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run([sys.executable, "-c", _LONG], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PEAK")][0]
    peak, io = int(line.split()[1]), int(line.split()[3])
    print(line)
    assert peak <= 2.5 * io, (peak, io)


# ------------------------------------------------- segment ids, bias (dbias), boolean mask
#
# They run in the portable (sm80) kernels, also on Hopper (kernel="auto" routes them there).
# Checked against the float64 reference under FlashAttention's 2x rule (out, lse, dq, dk, dv,
# dbias; test_features.check_case) and against the CPU backend.

# (B, T, S, N, K, H): odd lengths, GQA, T != S, every head-dim kernel (72 runs padded).
EXTRA_SHAPES = [
    (2, 67, 67, 4, 2, 64),
    (2, 300, 513, 4, 1, 128),
    (3, 129, 97, 2, 2, 256),
    (1, 190, 211, 6, 2, 72),
]


def _extras_case(name, B, T, S, N, K):
    """-> (dropin kwargs, reference kwargs, bias shape or None) for one named feature mix."""
    ids_q = packed_ids(1, B, T, 3)
    ids_k = ids_q if T == S else packed_ids(2, B, S, 3)
    kvl = jnp.array([max(1, S - 17 * b) for b in range(B)], jnp.int32)
    ql = jnp.array([max(0, T - 29 * b) for b in range(B)], jnp.int32)
    mask = rand_mask(7, (B, 1, T, S))
    mask = mask.at[:, :, 5::13, :].set(False)  # rows that see no key
    if name == "seg_causal":
        return (dict(is_causal=True, query_segment_ids=ids_q, key_value_segment_ids=ids_k),
                dict(causal=True, q_segment_ids=ids_q, kv_segment_ids=ids_k), None)
    if name == "seg_unsorted_window_lens_softcap":
        qi, ki = packed_ids(3, B, T, 3, sort=False), packed_ids(4, B, S, 3, sort=False)
        return (dict(query_segment_ids=qi, key_value_segment_ids=ki, local_window_size=(40, 9), softcap=8.0,
                     key_value_seq_lengths=kvl),
                dict(q_segment_ids=qi, kv_segment_ids=ki, window=(40, 9), softcap=8.0, kv_lens=kvl), None)
    if name == "bias_full_causal":
        return dict(is_causal=True), dict(causal=True), (B, N, T, S)
    if name == "bias_over_batch_softcap":
        return dict(softcap=5.0), dict(softcap=5.0), (1, N, T, S)
    if name == "bias_keys_only_lens":
        return (dict(key_value_seq_lengths=kvl, query_seq_lengths=ql), dict(kv_lens=kvl, q_lens=ql), (B, 1, 1, S))
    if name == "bias_over_keys":
        return dict(is_causal=True), dict(causal=True), (B, N, T, 1)
    if name == "mask_bias_seg_everything":
        return (dict(is_causal=True, mask=mask, query_segment_ids=ids_q, key_value_segment_ids=ids_k,
                     query_seq_lengths=ql, softcap=20.0),
                dict(causal=True, mask=mask, q_segment_ids=ids_q, kv_segment_ids=ids_k, q_lens=ql, softcap=20.0),
                (1, N, T, S))
    raise AssertionError(name)


EXTRA_CASES = ["seg_causal", "seg_unsorted_window_lens_softcap", "bias_full_causal", "bias_over_batch_softcap",
               "bias_keys_only_lens", "bias_over_keys", "mask_bias_seg_everything"]


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", EXTRA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", EXTRA_CASES)
def test_gpu_extras(case, shape, dtype):
    B, T, S, N, K, H = shape
    ours, ref, bias_shape = _extras_case(case, B, T, S, N, K)
    check_case(B, T, S, N, K, H, dtype, dropin(**ours), ref_of(**ref), bias_shape=bias_shape,
               seed=zlib.crc32(repr((case, shape)).encode()) % 1000)


@pytest.mark.parametrize("implementation", [None, "portable"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_extras_match_cpu_backend(dtype, implementation):
    """The same jitted function (mask, segment ids, a bias broadcast over batch, GQA, odd
    lengths) on the GPU and the CPU backend: out, lse and every gradient including dbias."""
    B, T, S, N, K, H = 2, 97, 145, 4, 2, 64
    q, k, v = random_qkv(11, B, T, S, N, K, H, dtype)
    bias = rand_bias(12, (1, N, T, S))
    ids_q, ids_k = packed_ids(13, B, T, 2), packed_ids(14, B, S, 2)
    mask = rand_mask(15, (B, 1, 1, S))

    def f(q, k, v, bias):
        out, lse = jax_flash.dot_product_attention(
            q, k, v, bias, mask, is_causal=True, query_segment_ids=ids_q, key_value_segment_ids=ids_k,
            return_residual=True, implementation=implementation)
        return out, lse

    def grads(q, k, v, bias):
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return out, lse, vjp((jnp.ones_like(out), jnp.zeros_like(lse)))

    gpu = jax.jit(grads)(q, k, v, bias)
    cpu_dev = jax.devices("cpu")[0]
    args = [jax.device_put(x, cpu_dev) for x in (q, k, v, bias)]
    with jax.default_device(cpu_dev):
        cpu = jax.jit(grads)(*args)
    flat_g, flat_c = jax.tree.leaves(gpu), jax.tree.leaves(cpu)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dbias"], flat_g, flat_c):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.array_equal(np.isneginf(a), np.isneginf(b)), name  # the same empty rows
        a, b = np.where(np.isneginf(a), 0, a), np.where(np.isneginf(b), 0, b)
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=3e-2 * scale, rtol=3e-2, err_msg=name)


def test_gpu_extras_deterministic_full_bias_is_bitwise_stable():
    """deterministic=True with a full-size bias: one dS per dbias element, so dbias is exact and
    every gradient is bit-identical run to run. A broadcast bias is refused at lowering."""
    B, T, S, N, H = 2, 300, 400, 2, 64
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in random_qkv(21, B, T, S, N, N, H, jnp.bfloat16))  # [B, N, L, H]
    bias = rand_bias(22, (B, N, T, S))
    mask = rand_mask(23, (T, S))

    def loss(q, k, v, bias):
        out = jax_flash.flash_attention(q, k, v, bias=bias, mask=mask, causal=True, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    first = g(q, k, v, bias)
    for _ in range(3):
        for x, y in zip(first, g(q, k, v, bias)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    with pytest.raises(ValueError, match="deterministic=True is not supported on the GPU with a bias broadcast"):
        g(q, k, v, bias[:1, :1])  # [1, 1, T, S]: summed over batch and heads


def test_gpu_hopper_kernel_with_extras_raises():
    q, k, v = random_qkv(31, 1, 64, 64, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="kernel='hopper' does not take bias"):
        jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, jnp.zeros((64, 64)), implementation="hopper"))(q, k, v)
