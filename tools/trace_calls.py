"""Kernel durations and gaps inside the benchmark's timed loops (GPU machine), per implementation.

tools/kernel_times.py measures each kernel under ncu, replayed on its own; the benchmark's wall
clock runs C calls back to back, where the board's power cap sets the clock and launches may
leave gaps. This runs one benchmark round (C forward calls, then C forward + backward calls) per
implementation under jax.profiler's trace (CUPTI) and reads the kernels' start / end times from
its Perfetto export, so the loop's own kernel times, gaps and wall span can be put side by side:

    python3 tools/trace_calls.py --impls jax_flash fa3_jax --cells 128:16384:0 128:4096:1 [--calls 10]

Per cell and implementation: for the forward loop and the forward + backward loop, the median
per-call duration of each kernel (names shortened), the per-call kernel sum, the per-call span
(first kernel start to the next call's first kernel start), the idle share of that span and the
longest kernel's range over the calls (the clock settling under load shows there); then the
backward as the benchmark's bwd column takes it, span(fwd + bwd) - span(fwd).
Cells are H:S:causal with the benchmark's shapes (B*S = 16k tokens, N*H = 2048), bf16 unless
--dtype says otherwise.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile


def _short(name):
    """A kernel's name without namespaces and template arguments (enough to tell them apart)."""
    base = re.sub(r"<.*", "", re.sub(r"^void ", "", name))
    base = base.split("(")[0].split("::")[-1]
    return base[:48] or name[:48]


def _device_events(trace_dir):
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise RuntimeError(f"no perfetto_trace.json.gz under {trace_dir}")
    data = json.load(gzip.open(sorted(paths)[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", "")) and "host" not in str(e["args"]["name"]).lower()}
    # Kernels sit on the stream tracks ("Stream #N(...)"); the same device also has derived tracks
    # ("XLA Modules", "XLA Ops") whose events span several kernels.
    streams = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in gpu_pids and "stream" in str(e.get("args", {}).get("name", "")).lower()}
    kernels = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and e.get("dur", 0) > 0
               and not e["name"].lower().startswith(("memcpy", "memset"))]
    if not kernels:
        tracks = sorted({str(e.get("args", {}).get("name")) for e in events if e.get("ph") == "M"
                         and e.get("name") in ("process_name", "thread_name")})
        raise RuntimeError(f"no kernel events on a GPU stream track; tracks: {tracks[:30]}")
    # One event per launch (a stream can be listed under two tracks).
    seen, out = set(), []
    for e in sorted(kernels, key=lambda e: (e["ts"], -e["dur"])):
        key = (round(e["ts"], 3), e["name"])
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _calls(events, n_calls):
    """Splits a loop's kernel events into calls by the launch sequence's period: the shortest
    per-call sequence of kernel names that repeats n_calls times at the end of the trace (a
    first call may carry one-off work in front)."""
    names = [e["name"] for e in events]
    for per in range(1, len(names) // n_calls + 1):
        tail = names[len(names) - per * n_calls:]
        if all(tail[i] == tail[i % per] for i in range(len(tail))):
            ev = events[len(events) - per * n_calls:]
            return [ev[i * per:(i + 1) * per] for i in range(n_calls)]
    return None


def _summary(events, n_calls):
    calls = _calls(events, n_calls)
    if calls is None:
        return {"error": f"{len(events)} kernel events for {n_calls} calls"}
    names = [_short(e["name"]) for e in calls[0]]
    per_kernel = [statistics.median(c[i]["dur"] for c in calls) for i in range(len(names))]
    sums = [sum(e["dur"] for e in c) for c in calls]
    spans = [calls[i + 1][0]["ts"] - calls[i][0]["ts"] for i in range(n_calls - 1)]
    busy = []  # union of kernel intervals per call (PDL kernels overlap their predecessor)
    for c in calls[:-1]:
        iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in c)
        tot, cur_s, cur_e = 0.0, *iv[0]
        for s, t in iv[1:]:
            if s > cur_e:
                tot, cur_s, cur_e = tot + cur_e - cur_s, s, t
            else:
                cur_e = max(cur_e, t)
        busy.append(tot + cur_e - cur_s)
    span = statistics.median(spans)
    longest = max(range(len(names)), key=lambda i: per_kernel[i])
    spread = [c[longest]["dur"] for c in calls]
    return {"kernels": list(zip(names, per_kernel)), "sum": statistics.median(sums), "span": span,
            "idle": 1.0 - statistics.median(busy) / span, "longest": (names[longest], min(spread), max(spread)),
            "per_call": spread}


def backward_from_spans(spans):
    """The backward's time per call as the benchmark's bwd column takes it (time(fwd + bwd) -
    time(fwd)), from the two loops' median spans; None unless both loops were read and the
    difference is positive."""
    if "fwd" not in spans or "fwd+bwd" not in spans:
        return None
    d = spans["fwd+bwd"] - spans["fwd"]
    return d if d > 0 else None


def _trace_loop(fn, args, calls):
    """The device kernels of `calls` back-to-back calls of fn, as the benchmark's rounds run them."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        return _device_events(d)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", nargs="+", default=["jax_flash", "fa3_jax"])
    ap.add_argument("--cells", nargs="+", default=["128:16384:0"])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--per-call", action="store_true", help="print the longest kernel's duration in every call")
    a = ap.parse_args(argv)

    import jax.numpy as jnp

    from jax_flash.bench import (BWD_FLOP_FACTOR, FWD_BWD_FLOP_FACTOR, _implementations, _warm_up, cell_inputs,
                                 forward_flops, grid_cell, timed_functions)

    impls = _implementations(True)
    for cell in a.cells:
        B, S, N, H, causal = grid_cell(cell)
        q, k, v, do = cell_inputs(B, S, N, H, jnp.dtype(a.dtype))
        flops = forward_flops(B, S, N, H, causal)
        print(f"\n## H={H} S={S} causal={causal} {a.dtype} (B={B}, N={N}), {a.calls} calls per loop; us per call")
        for name in a.impls:
            fwd, fwd_bwd = timed_functions(impls[name], causal)
            try:
                _warm_up(fwd, (q, k, v))
                _warm_up(fwd_bwd, (q, k, v, do))
                loops = {"fwd": _trace_loop(fwd, (q, k, v), a.calls), "fwd+bwd": _trace_loop(fwd_bwd, (q, k, v, do), a.calls)}
            except Exception as e:  # noqa: BLE001 - report and go on with the next implementation
                print(f"- {name}: {type(e).__name__}: {str(e)[:300]}")
                continue
            spans = {}
            for label, mult in (("fwd", 1.0), ("fwd+bwd", FWD_BWD_FLOP_FACTOR)):
                evs = loops[label]
                r = _summary(evs, a.calls)
                if "error" in r:
                    print(f"- {name} {label}: {r['error']}")
                    continue
                spans[label] = r["span"]
                ks_txt = ", ".join(f"{n} {t:.0f}" for n, t in r["kernels"])
                print(f"- {name} {label}: span {r['span']:.0f} ({mult * flops / r['span'] / 1e6:.0f} TFLOP/s), "
                      f"kernel sum {r['sum']:.0f}, idle {100 * r['idle']:.1f}% | {ks_txt} | "
                      f"{r['longest'][0]} over the calls {r['longest'][1]:.0f}-{r['longest'][2]:.0f}")
                if a.per_call:
                    print(f"    {r['longest'][0]} per call: {' '.join(f'{x:.0f}' for x in r['per_call'])}")
            bwd = backward_from_spans(spans)
            if bwd is not None:
                print(f"- {name} bwd (span(fwd+bwd) - span(fwd), the benchmark's bwd column): {bwd:.0f} "
                      f"({BWD_FLOP_FACTOR * flops / bwd / 1e6:.0f} TFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
