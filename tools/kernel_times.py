"""GPU time of every kernel one attention call launches, per implementation, under ncu.

The JAX benchmark times whole jitted calls by wall clock (ANCHORS.md's method); this splits
that into kernels, so a gap can be told apart from launch / dispatch overhead. Run on the GPU
machine:

    ncu --clock-control none --cache-control none --profile-from-start off \
        --metrics gpu__time_duration.sum --csv --log-file K.csv \
        python3 tools/kernel_times.py --impl jax_flash --cells 128:1024:1 64:4096:0 > K.order
    python3 tools/kernel_times.py --report K.csv K.order

--impl takes the benchmark's names (jax_flash.bench._implementations: jax_flash, cudnn, fa3_jax, ...).
fa3_jax needs the flash-attn3-jax wheel importable: tools/gpu_session.sh installs it under
/tmp/site, so outside a `gpu_session.sh run` step set PYTHONPATH=/tmp/site (session 34 lost one
fa3_jax run to that: KeyError 'fa3_jax').

Between calls a marker kernel (a jitted sin over 7 floats) splits the ncu log; the profiler
runs only around the measured calls (cuProfilerStart / Stop on the primary context).
More metrics after gpu__time_duration.sum (e.g. smsp__inst_executed.sum,
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum, lts__t_bytes.sum, dram__bytes.sum) add a table
of each per GFLOP, to compare what two implementations execute for the same work (session 24:
under the power cap the clock, hence the energy per FLOP, separates ours from FA3's forward).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import sys


def _profiler(on):
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    cu.cuInit(0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxPushCurrent_v2(ctx)
    rc = cu.cuProfilerStart() if on else cu.cuProfilerStop()
    cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    if rc:
        print(f"cuProfiler{'Start' if on else 'Stop'}: error {rc}", file=sys.stderr)


def measure(impl_name, cells, dtype_name):
    import jax
    import jax.numpy as jnp

    from jax_flash.bench import _implementations, cell_inputs, forward_flops, grid_cell, timed_functions

    impl = _implementations(True)[impl_name]
    dtype = jnp.dtype(dtype_name)
    marker = jax.jit(jnp.sin)  # XLA names its kernel after the op: "...sine..."
    mx = jnp.ones((7,), jnp.float32)
    jax.block_until_ready(marker(mx))
    runs = []
    for cell in cells:
        B, S, N, H, causal = grid_cell(cell)
        q, k, v, do = cell_inputs(B, S, N, H, dtype)
        fwd, fb = timed_functions(impl, causal)
        try:
            jax.block_until_ready(fwd(q, k, v))
            jax.block_until_ready(fb(q, k, v, do))
        except Exception as e:  # noqa: BLE001 - a peer that lacks a head dim
            print(f"# {impl_name} {cell}: {type(e).__name__}", file=sys.stderr)
            continue
        flops = forward_flops(B, S, N, H, causal)
        for what, fn, args in (("fwd", fwd, (q, k, v)), ("fwd+bwd", fb, (q, k, v, do))):
            _profiler(True)
            jax.block_until_ready(marker(mx))
            jax.block_until_ready(fn(*args))
            _profiler(False)
            runs.append(f"{impl_name} {dtype_name} H={H} S={S} causal={causal} {what} {flops}")
    _profiler(True)
    jax.block_until_ready(marker(mx))
    _profiler(False)
    print("\n".join(runs))


_TIME_SCALE_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def _kernels(rows):
    """ncu's CSV (one row per kernel launch and metric) -> [(kernel name, {metric: value})] in
    launch order; durations in us."""
    hdr = rows[0]
    id_i, name_i = hdr.index("ID"), hdr.index("Kernel Name")
    metric_i, val_i, unit_i = hdr.index("Metric Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
    out, index = [], {}
    for r in rows[1:]:
        if r[id_i] not in index:
            index[r[id_i]] = len(out)
            out.append((r[name_i], {}))
        try:
            value = float(r[val_i].replace(",", ""))
        except ValueError:  # "n/a" and the like
            value = float("nan")
        if r[metric_i] == "gpu__time_duration.sum":
            value *= _TIME_SCALE_US[r[unit_i]]
        out[index[r[id_i]]][1][r[metric_i]] = value
    return out


def report(csv_path, order_path):
    """Kernel times per run; with more metrics than the duration in the CSV, also each metric
    summed over a run's kernels per GFLOP of the run (the backward's rows: the whole fwd+bwd call),
    to set two implementations' executed work side by side."""
    from jax_flash.bench import BWD_FLOP_FACTOR, FWD_BWD_FLOP_FACTOR

    runs = [line.split() for line in open(order_path) if line.strip() and not line.startswith("#")]
    with open(csv_path) as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
    groups, cur = [], None
    for name, m in _kernels(rows):
        us = m.get("gpu__time_duration.sum", float("nan"))
        if "sine" in name.lower() and us < 50:
            if cur is not None:
                groups.append(cur)
            cur = []
        elif cur is not None:
            cur.append((name[:60], m))
    fwd_us = {}
    print("| impl | dtype | cell | pass | kernels (us) | total us | kernel TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for run, ks in zip(runs, groups):
        impl, dt, h, s, c, what, flops = run
        total = sum(m["gpu__time_duration.sum"] for _, m in ks)
        key = (impl, dt, h, s, c)
        if what == "fwd":
            fwd_us[key] = total
            tf = float(flops) / total / 1e6
        else:
            tf = BWD_FLOP_FACTOR * float(flops) / max(total - fwd_us.get(key, 0.0), 1e-9) / 1e6
        lst = ", ".join(f"{n.split('(')[0][-40:]} {m['gpu__time_duration.sum']:.0f}" for n, m in ks)
        print(f"| {impl} | {dt} | {h} {s} {c} | {what} | {lst} | {total:.0f} | {tf:.0f} |")
    metrics = sorted({k for ks in groups for _, m in ks for k in m} - {"gpu__time_duration.sum"})
    if metrics:
        print("\nPer GFLOP of the call (summed over its kernels)")
        print("| impl | dtype | cell | pass | " + " | ".join(metrics) + " |")
        print("|---|---|---|---|" + "---|" * len(metrics))
        for run, ks in zip(runs, groups):
            impl, dt, h, s, c, what, flops = run
            gflop = float(flops) * (FWD_BWD_FLOP_FACTOR if what != "fwd" else 1.0) / 1e9
            vals = [sum(m.get(k, 0.0) for _, m in ks) / gflop for k in metrics]
            print(f"| {impl} | {dt} | {h} {s} {c} | {what} | " + " | ".join(f"{v:.4g}" for v in vals) + " |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--impl")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cells", nargs="+", default=[])
    p.add_argument("--report", nargs=2, metavar=("CSV", "ORDER"))
    a = p.parse_args()
    if a.report:
        report(*a.report)
    else:
        measure(a.impl, a.cells, a.dtype)
