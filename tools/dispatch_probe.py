"""Where a jitted attention call's wall-clock time goes, per implementation (GPU machine).

The JAX benchmark (ANCHORS.md's method) times R rounds of C calls; at S = 1k a call is
~150-250 us, so host-side cost per call (Python dispatch + the FFI handler) shows up when it
is not hidden behind the GPU. For each cell and implementation this prints:
  host_us   time to enqueue one call (100 calls back to back, before any sync)
  steady_us wall time per call over 100 calls (GPU-bound if host_us < steady_us)
  bench_us  the benchmark's figure (median of 5 rounds of 5 calls)
  single_us one call, enqueue to completion (latency)

    python3 tools/dispatch_probe.py --cells 128:1024:1 64:1024:0 --impls jax_flash cudnn fa3_jax
"""

from __future__ import annotations

import argparse
import statistics
import time


def main():
    import jax
    import jax.numpy as jnp

    from jax_flash.bench import _implementations, cell_inputs, grid_cell, timed_functions

    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=["128:1024:1"])
    ap.add_argument("--impls", nargs="+", default=["jax_flash", "cudnn", "fa3_jax"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bwd", action="store_true", help="time fwd+bwd instead of fwd")
    a = ap.parse_args()
    impls = _implementations(True)
    dtype = jnp.dtype(a.dtype)
    print(f"{'cell':>12} {'impl':>10} {'host_us':>8} {'steady_us':>9} {'bench_us':>8} {'single_us':>9}")
    for cell in a.cells:
        B, S, N, H, causal = grid_cell(cell)
        q, k, v, do = cell_inputs(B, S, N, H, dtype)
        for name in a.impls:
            if name not in impls:
                continue
            fwd, fwd_bwd = timed_functions(impls[name], causal)
            fn, args = (fwd_bwd, (q, k, v, do)) if a.bwd else (fwd, (q, k, v))
            try:
                jax.block_until_ready(fn(*args))
            except Exception as e:  # noqa: BLE001 - a peer that lacks a head dim
                print(f"{cell:>12} {name:>10} {type(e).__name__}")
                continue
            jax.block_until_ready(fn(*args))
            t0 = time.perf_counter()
            for _ in range(100):
                out = fn(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            host, steady = (t1 - t0) / 100, (t2 - t0) / 100
            rounds = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(5):
                    out = fn(*args)
                jax.block_until_ready(out)
                rounds.append((time.perf_counter() - t0) / 5)
            singles = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                singles.append(time.perf_counter() - t0)
            print(f"{cell:>12} {name:>10} {host * 1e6:8.1f} {steady * 1e6:9.1f} "
                  f"{statistics.median(rounds) * 1e6:8.1f} {statistics.median(singles) * 1e6:9.1f}", flush=True)


if __name__ == "__main__":
    main()
