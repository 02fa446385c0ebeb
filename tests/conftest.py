"""Shared test setup: float64 references need x64; helpers for the FlashAttention error rule."""

import os

# Before jax initialises its backends: 8 host devices for the sharding tests, cheaper LLVM
# codegen for the many small reference computations (our kernels are native code), and on a
# GPU no autotuning of the references' GEMMs: a GPU test spends ~7 of its ~8 s compiling the
# two references (session 14), and the fastest GEMM algorithm buys a test nothing.
# JF_TEST_XLA_AUTOTUNE=1 keeps XLA's autotuning (tools/test_time_probe.py compares the two).
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    *([] if os.environ.get("JF_TEST_XLA_AUTOTUNE") == "1" else ["--xla_gpu_autotune_level=0"]),
])

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def _listed(path):
    with open(path) as f:
        return {line.strip() for line in f if line.strip()}


def pytest_collection_modifyitems(config, items):
    # A GPU test group longer than one device call resumes: JF_TEST_DONE names a file of test
    # ids already passed (JF_TEST_PASSED_LOG of earlier runs), which are deselected.
    done_file = os.environ.get("JF_TEST_DONE")
    if done_file:
        done = _listed(done_file)
        kept = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = kept
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """JF_TEST_PASSED_LOG: append the id of every test that passed (or skipped) to that file,
    as it finishes, so a run cut by a time limit still says what it covered."""
    log = os.environ.get("JF_TEST_PASSED_LOG")
    if log and ((report.when == "call" and report.passed) or report.skipped):
        with open(log, "a") as f:
            f.write(report.nodeid + "\n")


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request):
    """Tests not marked `gpu` specify the CPU backend, also on a GPU machine; the GPU
    kernels are specified by tests/test_gpu.py."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def random_qkv(key, B, T, S, N, K, H, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(key), 3)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
    return q, k, v


# Absolute slack added to 2x the naive error, per dtype: covers accumulation-order noise
# where the naive computation happens to be nearly exact.
ABS_SLACK = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-3, jnp.dtype(jnp.float16): 3e-4}


def max_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float64))
    b = np.asarray(jnp.asarray(b, jnp.float64))
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), "non-finite entries differ"
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))


def assert_flash_rule(name, ours, naive, ref, dtype):
    """FlashAttention's rule: our error vs the float64 reference is at most 2x the error of
    the same computation done naively in the input dtype (plus a small absolute slack)."""
    e_ours, e_naive = max_err(ours, ref), max_err(naive, ref)
    bound = 2 * e_naive + ABS_SLACK[jnp.dtype(dtype)]
    assert e_ours <= bound, f"{name}: error {e_ours:.3e} > 2 x naive {e_naive:.3e} + slack"


def assert_vmap_matches_loop(fn, args, in_axes, n=3):
    """jit(vmap(fn)) over the first n examples equals fn called on each example (unmapped
    arguments, in_axes None, are passed as their first example to both)."""
    args = [a if ax is not None else a[0] for a, ax in zip(args, in_axes)]
    got = jax.jit(jax.vmap(fn, in_axes=in_axes))(*args)
    for j in range(n):
        sl = [a[j] if ax is not None else a for a, ax in zip(args, in_axes)]
        np.testing.assert_allclose(got[j], fn(*sl), rtol=1e-5, atol=1e-6)


def reference_on_cpu() -> bool:
    """JF_TEST_CPU_REFS=1: GPU tests compute their float64 and naive references on the CPU
    backend (no GPU compile or autotuning per test; an experiment for the GPU test group's
    time, tools/test_time_probe.py). Off by default: the naive reference's rounding is then
    the CPU backend's, which the 2x rule has not been checked against on the GPU."""
    return os.environ.get("JF_TEST_CPU_REFS") == "1"


def run_reference(fn, *args):
    """fn(*args) where the references run: args moved to the CPU backend under
    JF_TEST_CPU_REFS=1, else as they are."""
    if not reference_on_cpu():
        return fn(*args)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        return fn(*(None if x is None else jax.device_put(x, cpu) for x in args))


def vjp_fn(fn, with_bias):
    """jit((q, k, v, bias, do) -> (out, lse, grads)) for fn(q, k, v, bias) -> (out, lse): grads
    are (dq, dk, dv) plus dbias if with_bias (lse gets a zero cotangent)."""

    def f(q, k, v, bias, do):
        if with_bias:
            (o, lse), vjp = jax.vjp(fn, q, k, v, bias)
        else:
            (o, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None), q, k, v)
        return o, lse, vjp((do.astype(o.dtype), jnp.zeros_like(lse)))

    return jax.jit(f)
