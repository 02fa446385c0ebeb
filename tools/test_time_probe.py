"""Where one GPU feature test's time goes: our kernels' compile + run, the float64 reference's,
the naive same-dtype reference's (tests/test_numerics.check_all's three jits), on one
test_gpu_features case. Run on the GPU machine after installing jax_flash, e.g. to compare the
test suite's XLA flags and where the references run:
    python3 tools/test_time_probe.py                          # the suite's defaults
    JF_TEST_XLA_AUTOTUNE=1 python3 tools/test_time_probe.py   # XLA's GEMM autotuning kept
    JF_TEST_CPU_REFS=1 python3 tools/test_time_probe.py       # references on the CPU backend
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import conftest  # noqa: E402,F401  (the suite's XLA flags and x64)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import assert_flash_rule, random_qkv, reference_on_cpu, run_reference  # noqa: E402
from test_numerics import FEATURES, _lengths, _value_and_grads, run_ours, run_ref  # noqa: E402

_t = time.perf_counter()


def lap(what):
    global _t
    now = time.perf_counter()
    print(f"  {what}: {now - _t:.1f} s", flush=True)
    _t = now


def main(feature="softcap", H=128, dtype=jnp.float16, kernel="auto"):
    B, T, S, N, K = 2, 300, 450, 4, 2  # test_gpu_features' shape
    print(f"{feature} H={H} {jnp.dtype(dtype).name} kernel={kernel}, references on the "
          f"{'CPU' if reference_on_cpu() else 'default device'}, XLA_FLAGS={os.environ['XLA_FLAGS']}")
    q, k, v = random_qkv(1, B, T, S, N, K, H, dtype)
    do = jax.random.normal(jax.random.key(7), q.shape, jnp.float32).astype(dtype)
    jax.block_until_ready((q, do))
    lap("backend init + inputs")
    ours, refk = FEATURES[feature]
    lens = _lengths(B, T, S, seed=B * 31 + T)
    got = jax.block_until_ready(_value_and_grads(run_ours(q, k, v, dict(ours, kernel=kernel), lens))(q, k, v, do))
    lap("ours: compile + run")
    ref = jax.block_until_ready(run_reference(_value_and_grads(run_ref(refk, lens, jnp.float64)),
                                              *(x.astype(jnp.float64) for x in (q, k, v, do))))
    lap("float64 reference: compile + run")
    naive = jax.block_until_ready(run_reference(_value_and_grads(run_ref(refk, lens, jnp.dtype(dtype))), q, k, v, do))
    lap("naive reference: compile + run")
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), (got[0], *got[2]), (naive[0], *naive[2]), (ref[0], *ref[2])):
        assert_flash_rule(name, a, b, c, dtype)
    lap("2x rule checks (passed)")


if __name__ == "__main__":
    main()
