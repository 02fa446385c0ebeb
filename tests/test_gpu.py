"""The GPU kernels (Hopper and portable paths) against the float64 reference under
FlashAttention's 2x rule, transforms on the GPU, long context and memory; segment ids, bias
(dbias), boolean masks and dropout against the reference and the CPU backend (dropout: the
dropped set bit for bit). Skipped (visibly) without a GPU."""

import os
import subprocess
import sys
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import jax_flash.flax as jf
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


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("feature", ["causal", "window_causal_offset", "lengths_causal_br"])
def test_gpu_h64_bounded_long(feature, dtype):
    """H = 64 with a right bound (causal, window) and more than 1024 keys: the Hopper forward's
    128-row tiles (TileConfig<64>::ShortCausalMaxS; up to 1024 keys it runs 64-row tiles)."""
    _case((1, 1500, 2048, 2, 1, 64), feature, dtype, "auto")


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("feature", ["plain", "softcap", "lengths"])
def test_gpu_wide_key_blocks(feature, dtype):
    """H = 64 without a right bound and with >= 4096 keys: the Hopper forward's 128 x 192 tiles
    (TileConfig<64>::LongN); 4099 keys leave a last block of 67."""
    _case((1, 300, 4099, 2, 1, 64), feature, dtype, "auto")


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("H,shape,feature", [
    # _case vmaps single-head calls over the heads: the backward sees batch B * N, one kv head.
    (256, (1, 2100, 9000, 2, 2), "plain"),     # 282 tiles of 64 keys (the by-role kernel): 18 in the tail
    (256, (1, 2100, 8500, 1, 1), "softcap"),   # 133 tiles (the row-split kernel): one in the tail
])
def test_gpu_backward_split_tail(H, shape, feature, dtype):
    """H = 256 (the head-dim split kernel) with more key-block tiles than SMs, no causal / window
    bound or lengths, and at least JF_BWD_SPLIT_MIN_STEPS (32) steps per tile: the Hopper
    backward runs the last round's tiles as a second launch, in pieces whose partial dK / dV
    meet in the workspace (NOTES.md v82b; H = 64 / 128 run the early dQ conversion instead,
    v84). GQA pieces (a piece starting inside another q head) run in the harness's split cases."""
    B, T, S, N, K = shape
    _case((B, T, S, N, K, H), feature, dtype, "auto")


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("H,shape,feature", [
    # Batch B * N after the vmap fold: key-block tiles over several rounds, the last part-empty.
    (128, (1, 1000, 4000, 18, 18), "plain"),   # 576 tiles of 13 steps (80 rows): 4.4 rounds
    (128, (2, 333, 3001, 9, 9), "softcap"),    # 432 tiles of 6 steps (64 rows)
    (64, (1, 700, 6000, 9, 9), "plain"),       # 423 tiles of 6 steps
    (128, (1, 2600, 2100, 18, 18), "plain"),   # 306 tiles of 33 steps: 42 in the last round
    (128, (1, 2600, 2432, 7, 7), "plain"),     # 133 tiles: one in the last round
    (128, (1, 2100, 4000, 15, 15), "softcap"),  # 480 tiles of 33 steps (64 rows)
    (64, (1, 4100, 4200, 5, 5), "plain"),      # 165 tiles: 33 in the last round
])
def test_gpu_backward_early_dq_conversion(H, shape, feature, dtype):
    """H = 64 / 128 persistent launches without a causal / window bound or lengths: the dQ
    conversion runs as a programmatic dependent of the main launch and converts each head's rows
    once its writers' counts are complete, beside the last tiles (NOTES.md v83, v84). A count
    completed too early would convert partial sums: dq would fail the 2x rule."""
    B, T, S, N, K = shape
    _case((B, T, S, N, K, H), feature, dtype, "auto")


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


@pytest.mark.parametrize("kernel", [None, "portable"])
def test_gpu_empty_batch(kernel):
    from test_api import check_empty_batch

    check_empty_batch(jnp.bfloat16, kernel)


@pytest.mark.parametrize("kernel", [None, "portable"])
def test_gpu_nan_inputs_propagate(kernel):
    from test_numerics import check_nan_propagation

    check_nan_propagation(jnp.bfloat16, kernel)


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
# They run in the portable (sm80) kernels, also on Hopper (kernel="auto" routes them there),
# except that without dropout the Hopper forward runs them there (not a bias at head dims <= 64,
# faster on the portable forward), and with segment ids alone
# the Hopper backward too (not with softcap, as in seg_unsorted_window_lens_softcap, or
# deterministic=True).
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


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_bias_with_zero_scale(dtype):
    """scale=0: the logits are the bias alone. The Hopper forward adds bias / scale to the
    unscaled logits, so these calls take the portable forward (hopper_fwd_takes_extras)."""
    B, T, S, N, K, H = 2, 100, 130, 4, 2, 128
    check_case(B, T, S, N, K, H, dtype, dropin(scale=0.0), ref_of(scale=0.0), bias_shape=(1, N, T, S), seed=5)


# name -> (causal, softcap, bias ([B, N, T] broadcast dims, dtype) or None, mask's or None,
# segment ids); the key axis is always full.
DENSE_LAYOUT_CASES = {
    "bias_f32": (False, None, ((2, 4, 300), jnp.float32), None, False),
    "bias_bf16_causal": (True, None, ((1, 4, 300), jnp.bfloat16), None, False),
    "bias_f16_softcap": (False, 6.0, ((2, 1, 300), jnp.float16), None, False),
    "mask": (False, None, None, (2, 4, 300), False),
    "mask_causal_with_bias": (True, None, ((2, 4, 300), jnp.float32), (2, 1, 300), False),
    "mask_bias_segments": (False, None, ((1, 4, 300), jnp.bfloat16), (1, 1, 300), True),
}


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(DENSE_LAYOUT_CASES))
@pytest.mark.parametrize("S", [510, 528])
@pytest.mark.parametrize("H", [64, 128, 256])
def test_gpu_dense_layouts(H, S, case, dtype):
    """Bias / mask with contiguous keys and an even key count: the Hopper forward's two faster
    ways to read them. S = 528 (rows 16-byte multiples): at H <= 128 the producer copies each
    key block's bias / mask tiles into smem by TMA (dense_tma.h), broadcast heads / batch
    included; the last of the 64-key blocks holds 16 keys and rows past T = 300 read as zeros.
    S = 510 (and H = 256): the element-wise loads, two neighbouring keys per load
    (dense_pairs_ok), the last pair clamped to keys 508-509. EXTRA_SHAPES have odd key counts."""
    B, T, N, K = 2, 300, 4, 2
    causal, softcap, bias, mask_bnt, segments = DENSE_LAYOUT_CASES[case]
    mask = None if mask_bnt is None else rand_mask(40 + H, (*mask_bnt, S))
    ids = dict(query_segment_ids=packed_ids(9, B, T, 3), key_value_segment_ids=packed_ids(10, B, S, 3)) if segments else {}
    ref_ids = dict(q_segment_ids=ids["query_segment_ids"], kv_segment_ids=ids["key_value_segment_ids"]) if ids else {}
    check_case(B, T, S, N, K, H, dtype, dropin(is_causal=causal, softcap=softcap, mask=mask, **ids),
               ref_of(causal=causal, softcap=softcap, mask=mask, **ref_ids),
               bias_shape=bias and (*bias[0], S), bias_dtype=bias[1] if bias else jnp.float32,
               seed=H + S + len(case))


# name -> (drop-in kwargs, reference kwargs, bias shape or None, bias dtype, mask shape or None)
# over B, T, S, N = 2, 200, 333, 4: each way dbias is summed (per element, over rows, over keys,
# over both), broadcast batch / heads, 16-bit biases, a mask with or without a bias.
_QL = jnp.array([200, 157], jnp.int32)
DENSE_BWD_CASES = {
    "bias_full_causal": (dict(is_causal=True), dict(causal=True), (2, 4, 200, 333), jnp.float32, None),
    "bias_bf16_shared_mask": ({}, {}, (1, 1, 200, 333), jnp.bfloat16, (2, 1, 200, 333)),
    "bias_over_rows": (dict(query_seq_lengths=_QL), dict(q_lens=_QL), (2, 4, 1, 333), jnp.float32, None),
    "bias_over_keys_window": (dict(local_window_size=(70, 30)), dict(window=(70, 30)), (1, 4, 200, 1), jnp.float16,
                              None),
    "bias_over_both_causal": (dict(is_causal=True), dict(causal=True), (2, 1, 1, 1), jnp.float32, None),
    "mask_only_lengths": (dict(query_seq_lengths=_QL), dict(q_lens=_QL), None, jnp.float32, (1, 4, 200, 333)),
}


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(DENSE_BWD_CASES))
@pytest.mark.parametrize("H", [64, 128, 256])
def test_gpu_dense_backward(H, case, dtype):
    """Bias / mask gradients: on Hopper the backward runs them in its Dense kernels (no softcap,
    not deterministic: cuda/sm90/dense_bwd.h); dq, dk, dv and dbias under the 2x rule. GQA 2:1,
    odd S; row 157 of batch 1 onwards are padding (lengths cases)."""
    B, T, S, N, K = 2, 200, 333, 4, 2
    ours, ref, bias_shape, bias_dtype, mask_shape = DENSE_BWD_CASES[case]
    mask = None if mask_shape is None else rand_mask(50 + H, mask_shape)
    check_case(B, T, S, N, K, H, dtype, dropin(mask=mask, **ours), ref_of(mask=mask, **ref), bias_shape=bias_shape,
               bias_dtype=bias_dtype, seed=H + len(case))


# name -> (drop-in kwargs, reference kwargs, bias shape or None, bias dtype, mask shape or None)
# over B, T, S, N, K = 2, 200, 336, 4, 2: rows of 16-byte multiples, so on Hopper at head dims
# 72..128 the backward's bias / mask tiles come by TMA (dense_bwd_tiles_by_tma), except for a
# float32 bias with a mask (no room: the element-wise path, here for comparison).
DENSE_TILE_CASES = {
    "f32_full_causal": (dict(is_causal=True), dict(causal=True), (2, 4, 200, 336), jnp.float32, None),
    "f32_shared": ({}, {}, (1, 1, 200, 336), jnp.float32, None),
    "bf16_mask_lengths": (dict(query_seq_lengths=_QL), dict(q_lens=_QL), (2, 1, 200, 336), jnp.bfloat16, (1, 4, 200, 336)),
    "f16_window": (dict(local_window_size=(70, 30)), dict(window=(70, 30)), (1, 4, 200, 336), jnp.float16, None),
    "mask_causal": (dict(is_causal=True), dict(causal=True), None, jnp.float32, (2, 4, 200, 336)),
    "f32_and_mask": ({}, {}, (2, 4, 200, 336), jnp.float32, (2, 1, 200, 336)),
}


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(DENSE_TILE_CASES))
@pytest.mark.parametrize("H", [96, 128])
def test_gpu_dense_backward_tiles(H, case, dtype):
    """Bias / mask gradients with the tiles by TMA in the Hopper backward (cuda/sm90/dense_bwd.h,
    NOTES.md v53): dq, dk, dv and dbias under the 2x rule; H = 96 runs padded on the 128 kernel."""
    B, T, S, N, K = 2, 200, 336, 4, 2
    ours, ref, bias_shape, bias_dtype, mask_shape = DENSE_TILE_CASES[case]
    mask = None if mask_shape is None else rand_mask(70 + H, mask_shape)
    check_case(B, T, S, N, K, H, dtype, dropin(mask=mask, **ours), ref_of(mask=mask, **ref), bias_shape=bias_shape,
               bias_dtype=bias_dtype, seed=H + 3 * len(case))


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 1, 1, 4, 2), (1, 1, 77, 2, 1), (2, 5, 3, 2, 2), (1, 70, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_dense_backward_tiny(shape, dtype):
    """Bias + mask gradients at the smallest lengths (decode T = 1, S = 1, T > S), H = 128: one
    partial tile, every key and row index past the ends clamped on the Hopper Dense backward."""
    B, T, S, N, K = shape
    mask = rand_mask(60 + T + S, (B, 1, T, S)).at[..., 0].set(True)  # every row sees key 0
    check_case(B, T, S, N, K, 128, dtype, dropin(mask=mask), ref_of(mask=mask), bias_shape=(1, N, T, S),
               seed=T * 7 + S)


_ROUTING_SCRIPT = """
import jax, jax.numpy as jnp, jax_flash
q = k = v = jnp.ones((1, 256, 2, 128), jnp.bfloat16) * 0.1
bias = jnp.zeros((1, 2, 256, 256), jnp.float32)
mask = jnp.ones((1, 1, 256, 256), bool)
def grads(**kw):
    f = lambda q, k, v: jnp.sum(jax_flash.dot_product_attention(q, k, v, **kw).astype(jnp.float32))
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v))
grads(bias=bias)
grads(mask=mask, is_causal=True)
grads(bias=bias, softcap=20.0)
grads(bias=bias, mask=mask)  # a float32 bias and a mask: the backward's tiles have no room for both
grads(bias=bias[..., :1])    # broadcast over keys: no TMA tiles
grads(mask=mask, dropout_rate=0.1, dropout_rng=jax.random.key(0))
grads(dropout_rate=0.1, dropout_rng=jax.random.key(0))
grads(dropout_rate=0.1, dropout_rng=jax.random.key(0), softcap=20.0)
"""


def test_gpu_kernel_routing_on_hopper(tmp_path):
    """Which kernels run calls with optional inputs (kernel='auto'), from the handlers' log
    (JAX_FLASH_LOG_KERNELS=1): on Hopper both passes of bias / mask calls run the Hopper kernels,
    with the tiles by TMA where the layout allows ("tiles"; the backward not for a float32 bias
    with a mask); softcap sends the backward of a bias call to the portable kernels; dropout runs on
    the Hopper kernels alone (its backward not with softcap), with a mask on the portable ones."""
    if jax.devices()[0].compute_capability != "9.0":
        pytest.skip("not a Hopper GPU")
    env = dict(os.environ, JAX_FLASH_LOG_KERNELS="1")
    run = subprocess.run([sys.executable, "-c", _ROUTING_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)  # the installed package, not the source tree's jax_flash/
    assert run.returncode == 0, run.stderr[-3000:]
    log = {line for line in run.stderr.splitlines() if line.startswith("jax_flash: ")}
    expected = {
        "jax_flash: forward hopper tiles head_dim=128 bias", "jax_flash: backward hopper tiles head_dim=128 bias",
        "jax_flash: forward hopper tiles head_dim=128 mask", "jax_flash: backward hopper tiles head_dim=128 mask",
        "jax_flash: backward portable head_dim=128 bias",  # softcap
        "jax_flash: forward hopper tiles head_dim=128 bias mask", "jax_flash: backward hopper head_dim=128 bias mask",
        "jax_flash: forward hopper head_dim=128 bias", "jax_flash: backward hopper head_dim=128 bias",
        "jax_flash: forward portable head_dim=128 mask dropout", "jax_flash: backward portable head_dim=128 mask dropout",
        "jax_flash: forward hopper head_dim=128 dropout", "jax_flash: backward hopper head_dim=128 dropout",
        "jax_flash: backward portable head_dim=128 dropout",  # softcap
    }
    assert log == expected, sorted(log)


@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("segments", [3, 40])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("H", [64, 128, 256])
def test_gpu_packed_sequences(H, causal, segments, dtype):
    """Packed sequences over 1000 tokens, few long segments or many short ones. On Hopper both
    passes run the Hopper kernels here (segment ids alone): each 64-row chunk (forward) or
    64-key chunk (backward) reads only the blocks of its segments, and blocks inside one segment
    skip the element test."""
    B, T, N, K = 2, 1000, 4, 2
    ids = packed_ids(31 + segments, B, T, segments)
    check_case(B, T, T, N, K, H, dtype, dropin(is_causal=causal, query_segment_ids=ids, key_value_segment_ids=ids),
               ref_of(causal=causal, q_segment_ids=ids, kv_segment_ids=ids), seed=H + segments + causal)


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


def test_gpu_flax_bias_runs_the_kernels():
    """jax_flash.flax with a Flax bias (two batch dims, broadcast over heads) on the GPU runs the
    kernels, not Flax's attention, with no fallback warning: out and every gradient (dbias too)
    match the same function on the CPU backend."""
    shape = (2, 3, 77, 4, 64)  # batch dims (2, 3), length 77, 4 heads, head dim 64
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(jnp.bfloat16) for i in range(3))
    bias = jax.random.normal(jax.random.key(3), (2, 3, 1, 77, 77), jnp.float32)

    def grads(q, k, v, bias):
        out, vjp = jax.vjp(lambda q, k, v, b: jf.dot_product_attention(q, k, v, bias=b, is_causal=True),
                           q, k, v, bias)
        return out, vjp(jnp.ones_like(out))

    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)
        assert "jax_flash_fwd" in jax.jit(grads).lower(q, k, v, bias).as_text()
        gpu = jax.jit(grads)(q, k, v, bias)
    cpu_dev = jax.devices("cpu")[0]
    with jax.default_device(cpu_dev):
        cpu = jax.jit(grads)(*(jax.device_put(x, cpu_dev) for x in (q, k, v, bias)))
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], jax.tree.leaves(gpu), jax.tree.leaves(cpu)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=3e-2 * scale, rtol=3e-2, err_msg=name)


def test_gpu_hopper_kernel_with_extras_raises():
    q, k, v = random_qkv(31, 1, 64, 64, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="kernel='hopper' does not take bias"):
        jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, jnp.zeros((64, 64)), implementation="hopper"))(q, k, v)


# ---------------------------------------------------------------------------------- dropout
#
# The portable (sm80) kernels, and on Hopper the Hopper kernels (kernel="auto": dropout without
# segment ids, bias or mask; the backward also without softcap). Their keep decisions are those
# of the CPU backend (one Philox4x32-10 per (seed, b, h, i, j // 4), cuda/common/philox.h):
# checked bit for bit against the numpy Philox of test_dropout.py, and outputs / gradients
# against the float64 reference with that mask and against the CPU backend run with the same key.

from test_dropout import check_case as dropout_check_case  # noqa: E402
from test_dropout import np_keep, seed_of  # noqa: E402

# (B, T, S, N, K, H, rate, drop-in kwargs, reference kwargs, bias shape, broadcast_dropout):
# causal, GQA, odd T / S (partial 4-column groups), T != S, head dims 64 / 96 / 128 / 256 (and
# 72, padded), lengths, a bias (dbias under dropout), one mask for every batch and head.
_KVL = jnp.array([120, 61], jnp.int32)
DROPOUT_CASES = {
    "causal_gqa": (2, 67, 67, 4, 2, 64, 0.3, dict(is_causal=True), dict(causal=True), None, False),
    "mqa_t_ne_s": (2, 129, 300, 4, 1, 128, 0.5, {}, {}, None, False),
    "causal_t_gt_s_h96": (1, 190, 97, 6, 2, 96, 0.2, dict(is_causal=True), dict(causal=True), None, False),
    "broadcast": (2, 97, 211, 2, 2, 128, 0.4, {}, {}, None, True),
    "lengths_bias_h72": (2, 75, 133, 4, 4, 72, 0.3, dict(key_value_seq_lengths=_KVL), dict(kv_lens=_KVL),
                         (1, 4, 75, 133), False),
    "h256": (1, 300, 257, 2, 1, 256, 0.25, dict(is_causal=True), dict(causal=True), None, False),
    # Many key / query blocks per (batch, head): the Hopper kernels' tile loops and schedules
    # (causal: the dynamic one), and softcap (Hopper forward, portable backward).
    "long_causal_gqa": (1, 700, 900, 4, 2, 128, 0.2, dict(is_causal=True), dict(causal=True), None, False),
    "long_h64": (2, 300, 1100, 2, 1, 64, 0.1, {}, {}, None, False),
    "window_h256": (1, 520, 600, 2, 2, 256, 0.15, dict(local_window_size=(200, 50)), dict(window=(200, 50)), None,
                    False),
    "softcap": (2, 200, 333, 2, 2, 128, 0.3, dict(softcap=20.0), dict(softcap=20.0), None, False),
}

# kernel="auto" (on Hopper the Hopper kernels where they take the call) and the portable kernels.
DROPOUT_IMPLS = {"auto": None, "portable": "portable"}


@pytest.mark.parametrize("impl", list(DROPOUT_IMPLS))
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_gpu_dropout_matches_reference_and_cpu_backend(case, dtype, impl):
    """out, lse, dq, dk, dv (dbias) under the 2x rule against the float64 reference with the numpy
    Philox mask, and against the CPU backend with the same key (rounding differences only)."""
    B, T, S, N, K, H, rate, kw, rkw, bias_shape, broadcast = DROPOUT_CASES[case]
    kw = dict(kw, implementation=DROPOUT_IMPLS[impl])
    dropout_check_case(B, T, S, N, K, H, dtype, rate, kw, rkw, bias_shape=bias_shape, broadcast=broadcast,
                       seed=zlib.crc32(case.encode()) % 1000, against_cpu=True)


def _gpu_keep_masks(B, T, S, N, rate, rng, dtype, broadcast=False, impl="auto"):
    """The kernels' keep masks [B, N, T, S] read off the GPU, from the forward and from the
    backward (no GQA; H = S >= T). q = 0 makes P uniform: with v = identity, out[b, t, n, s] =
    keep / (S (1 - rate)); with dO[b, t, n] = e_t, dV[b, s, n, t] = keep[b, n, t, s] / (S (1 - rate)),
    a single product. Both are exactly 0 where dropped."""
    q = jnp.zeros((B, T, N, S), dtype)
    v = jnp.broadcast_to(jnp.eye(S, dtype=dtype)[None, :, None, :], (B, S, N, S))
    do = jnp.broadcast_to(jnp.eye(T, S, dtype=dtype)[None, :, None, :], (B, T, N, S))
    f = lambda v: jax_flash.dot_product_attention(q, v, v, dropout_rate=rate, dropout_rng=rng,
                                                  broadcast_dropout=broadcast, implementation=DROPOUT_IMPLS[impl])

    def out_and_dv(v, do):  # v also serves as k: dK = scale * dS^T Q = 0 exactly, so this is dV
        out, vjp = jax.vjp(f, v)
        return out, vjp(do)[0]

    out, dv = jax.jit(out_and_dv)(v, do)
    fwd = np.asarray(out, np.float64).transpose(0, 2, 1, 3) * S  # [B, N, T, S]: keep / (1 - rate)
    bwd = np.asarray(dv, np.float64).transpose(0, 2, 3, 1)[:, :, :T] * S
    for got in (fwd, bwd):  # exactly 0 or, up to 16-bit rounding, 1 / (1 - rate)
        np.testing.assert_allclose(got, (got > 0.5) / (1 - rate), rtol=1e-2, atol=0)
    return fwd > 0.5, bwd > 0.5


# (B, T, S, N): the head-dim-256 kernels (S = H = 230: a partial last group, padded to 232) and
# the 128 ones (126, padded to 128); their forward and backward tiles differ.
KEEP_SHAPES = [(2, 150, 230, 3), (1, 100, 126, 4)]


@pytest.mark.parametrize("impl", list(DROPOUT_IMPLS))
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", KEEP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_gpu_dropout_mask_is_the_philox_mask_with_the_right_rate(rate, shape, dtype, impl):
    """The dropped set of the GPU forward and backward equals the numpy Philox mask (hence the
    CPU backend's) bit for bit; the kept fraction, over all and per Philox output word, is within
    5 sigma of 1 - rate."""
    B, T, S, N = shape
    rng = jax.random.key(int(rate * 100) + S)
    want = np_keep(seed_of(rng), B, N, T, S, rate)
    fwd, bwd = _gpu_keep_masks(B, T, S, N, rate, rng, dtype, impl=impl)
    np.testing.assert_array_equal(fwd, want)
    np.testing.assert_array_equal(bwd, want)
    sigma = lambda n: np.sqrt(rate * (1 - rate) / n)
    assert abs(fwd.mean() - (1 - rate)) < 5 * sigma(fwd.size), (fwd.mean(), 1 - rate)
    for r in range(4):
        part = fwd[..., r::4]
        assert abs(part.mean() - (1 - rate)) < 5 * sigma(part.size), (r, part.mean())


@pytest.mark.parametrize("impl", list(DROPOUT_IMPLS))
def test_gpu_broadcast_dropout_mask(impl):
    B, T, S, N = 2, 40, 72, 3
    rng = jax.random.key(3)
    fwd, bwd = _gpu_keep_masks(B, T, S, N, 0.4, rng, jnp.bfloat16, broadcast=True, impl=impl)
    want = np_keep(seed_of(rng), B, N, T, S, 0.4, broadcast=True)
    np.testing.assert_array_equal(fwd, want)
    np.testing.assert_array_equal(bwd, want)
    np.testing.assert_array_equal(fwd, np.broadcast_to(fwd[:1, :1], fwd.shape))


def test_gpu_dropout_vmap_of_grad_and_jit():
    """Per-example gradients under vmap (a key per example; every operand mapped: the batch fold;
    q alone mapped: the GQA-group fold in the forward, the batch fold in the backward) equal the
    per-example calls: the folds keep each example's key and coordinates on the GPU too."""
    B, T, S, N, K, H = 3, 64, 80, 4, 2, 64
    q, k, v = random_qkv(41, B, T, S, N, K, H, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(42), B)
    loss = lambda q, k, v, rng: jnp.sum(jax_flash.dot_product_attention(
        q, k, v, is_causal=True, dropout_rate=0.3, dropout_rng=rng).astype(jnp.float32) ** 2)
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=2e-2 * max(1.0, float(np.abs(b).max())), rtol=2e-2)

    for in_axes, kv_of in (((0, 0, 0, 0), lambda x, j: x[j]), ((0, None, None, 0), lambda x, j: x[0])):
        args = (q, k if in_axes[1] == 0 else k[0], v if in_axes[2] == 0 else v[0], keys)
        got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_axes))(*args)
        for j in range(B):
            want = g(q[j], kv_of(k, j), kv_of(v, j), keys[j])
            for a, w in zip(got, want):
                close(a[j], w)
    # Dropout is on (another key, other gradients) and the same key repeats the same mask.
    a, b = g(q[0], k[0], v[0], keys[0]), g(q[0], k[0], v[0], keys[1])
    assert float(jnp.abs(a[2].astype(jnp.float32) - b[2].astype(jnp.float32)).max()) > 0.1
    close(g(q[0], k[0], v[0], keys[0])[2], a[2])


def test_gpu_hopper_kernel_with_dropout_raises():
    q, k, v = random_qkv(32, 1, 64, 64, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="kernel='hopper' does not take dropout"):
        jax.jit(lambda q, k, v: jax_flash.dot_product_attention(
            q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="hopper"))(q, k, v)
