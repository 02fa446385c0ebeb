"""jax_flash.flax: the attention_fn of Flax's linen and nnx attention modules. Same outputs
and gradients as the modules' default attention; key-prefix masks (padding, the decode cache)
run the kernels with lengths, other masks Flax's own attention (chosen on the device); bias
and active dropout run the kernels (dropout with jax_flash's own mask, checked against the
numpy Philox of test_dropout.py); lowered for a GPU, bias and dropout run the kernels too, and
a bias with inputs the GPU kernels do not take (float32) Flax's attention; attention weights
are an error."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash  # noqa: E402
import jax_flash.flax as jf  # noqa: E402
from jax_flash import reference  # noqa: E402
from test_dropout import np_keep, seed_of  # noqa: E402

B, T, D, HEADS = 2, 37, 64, 4  # odd length on purpose


def _x(seed, shape=(B, T, D)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)


def _linen_pair(**kw):
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, **kw)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.dot_product_attention, **kw)
    return ref, ours


def _value_and_grad(module, params, x):
    loss = lambda p, x: jnp.sum(module.apply(p, x) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def test_linen_self_attention_matches_default():
    x = _x(0)
    ref, ours = _linen_pair()
    params = ref.init(jax.random.key(1), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)  # must take the kernel
        (v1, (gp1, gx1)) = _value_and_grad(ours, params, x)
    (v0, (gp0, gx0)) = _value_and_grad(ref, params, x)
    _close(v1, v0, 1e-4)
    _close(gx1, gx0)
    jax.tree.map(_close, gp1, gp0)


def test_linen_causal_attention_without_mask_matches_default_with_causal_mask():
    x = _x(2)
    ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=jf.causal_attention)
    params = ref.init(jax.random.key(3), x)
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    want = ref.apply(params, x, mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)
        got = jax.jit(ours.apply)(params, x)
    _close(got, want)


def test_linen_cross_attention_and_extra_batch_dims():
    q_in, kv_in = _x(4, (3, B, T, D)), _x(5, (3, B, 50, D))  # two batch dims, S != T
    ref, ours = _linen_pair()
    params = ref.init(jax.random.key(6), q_in, kv_in)
    _close(jax.jit(ours.apply)(params, q_in, kv_in), ref.apply(params, q_in, kv_in))


def test_nnx_is_causal_matches_default_values_and_grads():
    ref = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=nnx.Rngs(0),
                                  attention_fn=jf.dot_product_attention)
    x = _x(7)

    def loss(m, x):
        return jnp.sum(m(x, is_causal=True) ** 2)

    v0, g0 = nnx.value_and_grad(loss)(ref, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)
        v1, g1 = nnx.jit(nnx.value_and_grad(loss))(ours, x)
    _close(v1, v0, 1e-4)
    jax.tree.map(_close, nnx.state(g1, nnx.Param), nnx.state(g0, nnx.Param))


@pytest.fixture
def kernel_runs(monkeypatch):
    """Counts the executions (not traces) of the kernel branch: masks choose it on the device."""
    runs = []
    kernel = jf._kernel_attention

    def spy(*args, **kwargs):
        jax.debug.callback(lambda: runs.append(1))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(jf, "_kernel_attention", spy)
    return runs


def test_key_padding_mask_runs_the_kernels_with_lengths(kernel_runs):
    x = _x(8)
    ref, ours = _linen_pair()
    params = ref.init(jax.random.key(9), x)
    key_valid = jnp.arange(T)[None, :] < jnp.array([T, 20])[:, None]
    mask = nn.make_attention_mask(jnp.ones((B, T), bool), key_valid)  # [B, 1, T, T]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)
        got = jax.jit(ours.apply)(params, x, mask=mask)
    jax.effects_barrier()
    _close(got, ref.apply(params, x, mask=mask))
    assert kernel_runs == [1]
    lengths, ok = jf.key_prefix_lengths(mask, (B,), HEADS, T, T)
    assert bool(ok) and lengths.tolist() == [T, 20]


def test_other_masks_run_flax_attention_exactly(kernel_runs):
    x = _x(18)
    ref, ours = _linen_pair()
    params = ref.init(jax.random.key(19), x)
    keep = jax.random.bernoulli(jax.random.key(10), 0.7, (B, T))
    masks = {
        "random padding (query rows masked too)": nn.make_attention_mask(keep, keep),
        "causal as a mask": nn.make_causal_mask(jnp.ones((B, T))),
        "an empty key prefix": nn.make_attention_mask(jnp.ones((B, T)), jnp.zeros((B, T))),
    }
    for name, mask in masks.items():
        got = jax.jit(ours.apply)(params, x, mask=mask)
        jax.effects_barrier()
        _close(got, ref.apply(params, x, mask=mask))
        assert not kernel_runs, name


def test_linen_decode_cache_takes_the_lengths_path(kernel_runs):
    # Autoregressive decoding with the module's KV cache: each step's mask is
    # arange(max_length) <= cur_index, a key prefix, so the kernels read only the live keys.
    x = _x(20)
    ref, ours = _linen_pair(decode=True)
    params = ref.init(jax.random.key(21), x)
    cache = {"cache": params["cache"]}
    vars_ref, vars_ours = {"params": params["params"], **cache}, {"params": params["params"], **cache}
    step_ref = jax.jit(lambda v, x: ref.apply(v, x, mutable=["cache"]))
    step_ours = jax.jit(lambda v, x: ours.apply(v, x, mutable=["cache"]))
    for t in range(5):
        xt = x[:, t:t + 1]
        want, c_ref = step_ref(vars_ref, xt)
        got, c_ours = step_ours(vars_ours, xt)
        vars_ref, vars_ours = {**vars_ref, **c_ref}, {**vars_ours, **c_ours}
        _close(got, want)
    jax.effects_barrier()
    assert len(kernel_runs) == 5


def test_nnx_decode_cache_takes_the_lengths_path(kernel_runs):
    kw = dict(num_heads=HEADS, in_features=D, decode=True)
    ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0), attention_fn=jf.dot_product_attention)
    x = _x(22)
    for m in (ref, ours):
        m.init_cache(x.shape)
    for t in range(4):
        xt = x[:, t:t + 1]
        _close(ours(xt), ref(xt))
    jax.effects_barrier()
    assert len(kernel_runs) == 4


def test_active_dropout_runs_the_kernels(kernel_runs):
    x = _x(11)
    ref, ours = _linen_pair(dropout_rate=0.3)
    params = ref.init(jax.random.key(12), x, deterministic=True)
    train = jax.jit(lambda p, x, rng: ours.apply(p, x, deterministic=False, rngs={"dropout": rng}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)  # on the CPU: the kernels
        a, b = train(params, x, jax.random.key(13)), train(params, x, jax.random.key(13))
        c = train(params, x, jax.random.key(14))
        evaluated = ours.apply(params, x, deterministic=True)  # a dropout rate, deterministic: no dropout
    jax.effects_barrier()
    assert len(kernel_runs) == 4
    np.testing.assert_array_equal(a, b)  # same key, same mask
    assert float(jnp.abs(a - c).max()) > 1e-2
    assert float(jnp.abs(a - evaluated).max()) > 1e-2
    _close(evaluated, ref.apply(params, x, deterministic=True))
    # Training works through it: finite parameter gradients.
    grads = jax.grad(lambda p: jnp.sum(ours.apply(p, x, deterministic=False, rngs={"dropout": jax.random.key(1)}) ** 2))(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_dropout", "per_example"])
def test_dropout_is_the_philox_mask(broadcast):
    """Direct attention_fn call with two batch dims: the kernels' output equals the float64
    reference with the numpy Philox mask; broadcast_dropout=True (Flax's default) shares one mask
    across batch and heads, False gives each (flattened batch, head) its own."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 3, 13, 2, 8), jnp.float32) for i in range(3))
    rng, rate = jax.random.key(5), 0.4
    got = jf.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=rate, broadcast_dropout=broadcast)
    keep = np_keep(seed_of(rng), 6, 2, 13, 13, rate, broadcast=broadcast)
    flat = lambda x: x.reshape(6, 13, 2, 8).astype(jnp.float64)
    want, _ = reference.attention(flat(q), flat(k), flat(v), dropout_keep=keep, dropout_rate=rate)
    _close(got, want.reshape(got.shape), 1e-5)
    wrong, _ = reference.attention(flat(q), flat(k), flat(v), dropout_keep=np_keep(
        seed_of(rng), 6, 2, 13, 13, rate, broadcast=not broadcast), dropout_rate=rate)
    assert float(jnp.abs(got - wrong.reshape(got.shape)).max()) > 1e-2


BIASES = {  # shapes broadcastable to [2, 3, heads 2, 13, 17] (two batch dims)
    "full": (2, 3, 2, 13, 17),
    "over_batch": (2, 13, 17),
    "some_batch_dims": (2, 1, 1, 13, 17),
    "over_keys": (3, 1, 13, 1),
}


@pytest.mark.parametrize("case", list(BIASES))
def test_bias_runs_the_cpu_kernels_like_flax(case):
    """Flax adds the bias to the scaled logits: outputs and every gradient (dbias too) match
    flax.linen.dot_product_attention, with no fallback warning."""
    q = jax.random.normal(jax.random.key(0), (2, 3, 13, 2, 8), jnp.float32)
    k, v = (jax.random.normal(jax.random.key(i), (2, 3, 17, 2, 8), jnp.float32) for i in (1, 2))
    bias = jax.random.normal(jax.random.key(3), BIASES[case], jnp.float32)
    loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v, b: jnp.sum(jnp.sin(fn(q, k, v, bias=b))),
                                                 argnums=(0, 1, 2, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jf.JaxFlashFallbackWarning)
        v1, g1 = loss(jf.dot_product_attention)(q, k, v, bias)
    v0, g0 = loss(nn.dot_product_attention)(q, k, v, bias)
    _close(v1, v0, 1e-4)
    for a, b in zip(g1, g0):
        assert a.shape == b.shape
        _close(a, b, 1e-4)


def test_bias_with_masks(kernel_runs):
    """bias with a key-prefix mask: the kernels with lengths; with any other mask: Flax's."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 11, 2, 8), jnp.float32) for i in range(3))
    bias = jax.random.normal(jax.random.key(4), (2, 11, 11), jnp.float32)
    prefix = nn.make_attention_mask(jnp.ones((2, 11)), jnp.arange(11)[None] < jnp.array([[11], [6]]))
    other = nn.make_causal_mask(jnp.ones((2, 11)))
    for mask, runs in ((prefix, [1]), (other, [1])):  # runs: kernel executions so far
        got = jax.jit(lambda q, k, v, m: jf.dot_product_attention(q, k, v, bias=bias, mask=m))(q, k, v, mask)
        jax.effects_barrier()
        _close(got, nn.dot_product_attention(q, k, v, bias=bias, mask=mask))
        assert kernel_runs == runs


def test_bias_and_dropout_lowered_for_a_gpu_run_the_kernels(monkeypatch):
    """Lowered for a GPU, bf16 calls with a bias and / or dropout run the kernels (no warning);
    a bias with float32 inputs (which the GPU kernels do not take) runs Flax's attention there,
    with a fallback warning when the default backend is a GPU. On the CPU: the kernels."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 11, 2, 8), jnp.bfloat16) for i in range(3))
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    bias = jnp.zeros((2, 11, 11), jnp.float32)
    rng = jax.random.key(0)
    kernels = ["jax_flash_fwd"]
    calls = {
        "bias": (lambda q, k, v: jf.dot_product_attention(q, k, v, bias=bias), (q, k, v), kernels),
        "dropout": (lambda q, k, v: jf.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=0.1),
                    (q, k, v), kernels),
        "bias_and_dropout": (lambda q, k, v: jf.dot_product_attention(q, k, v, bias=bias, dropout_rng=rng,
                                                                      dropout_rate=0.1), (q, k, v), kernels),
        "bias_float32": (lambda q, k, v: jf.dot_product_attention(q, k, v, bias=bias), (q32, k32, v32), []),
    }
    for name, (fn, args, on_gpu) in calls.items():
        for platform, want in (("cuda", on_gpu), ("cpu", kernels)):
            exp = jax.export.export(jax.jit(fn), platforms=[platform],
                                    disabled_checks=jax_flash.export_disabled_checks())(*args)
            assert re.findall(r"custom_call @(\w+)", exp.mlir_module()) == want, (name, platform)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        if on_gpu:
            with warnings.catch_warnings():
                warnings.simplefilter("error", jf.JaxFlashFallbackWarning)
                fn(*args)
        else:
            with pytest.warns(jf.JaxFlashFallbackWarning, match="the GPU kernels take bfloat16"):
                fn(*args)
        monkeypatch.undo()


def test_asking_for_attention_weights_is_an_error():
    x = _x(14)
    _, ours = _linen_pair()
    params = ours.init(jax.random.key(15), x)
    with pytest.raises(ValueError, match="attention weights"):
        ours.apply(params, x, sow_weights=True)


def test_mask_with_fewer_kv_heads_is_a_clear_error():
    """Called directly with GQA operands and a mask: a ValueError pointing to
    jax_flash.dot_product_attention (Flax's attention, the mask fallback, needs equal heads)."""
    q = jnp.ones((2, 5, 4, 8), jnp.float32)
    k = jnp.ones((2, 7, 2, 8), jnp.float32)
    mask = jnp.ones((2, 1, 5, 7), bool)
    with pytest.raises(ValueError, match="fewer key/value heads"):
        jf.dot_product_attention(q, k, k, mask=mask)


def test_dtype_argument_casts_like_flax():
    x = _x(16)
    ref, ours = _linen_pair(dtype=jnp.bfloat16)
    params = ref.init(jax.random.key(17), x)
    got, want = ours.apply(params, x), ref.apply(params, x)
    assert got.dtype == want.dtype == jnp.bfloat16
    _close(got.astype(jnp.float32), want.astype(jnp.float32), 5e-2)


def test_example_language_model_trains_the_same_with_jax_flash():
    # examples/flax_lm.py, a few steps: identical batches and init, so the loss curves agree.
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flax_lm.py"
    spec = importlib.util.spec_from_file_location("flax_lm", path)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    data = lm.corpus()
    ref, _ = lm.train(False, data, steps=6, batch=4, seq=33, dtype=jnp.float32)
    ours, _ = lm.train(True, data, steps=6, batch=4, seq=33, dtype=jnp.float32)
    assert ref[-1] < ref[0]  # it learns
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
