"""Benchmark: jax_flash against cuDNN, XLA and any installed peer (flash-attn3-jax), forward
and backward, on the FlashAttention papers' grid (B*S = 16k tokens, N*H = 2048).

    jax-flash-bench                 # GPU grid if a GPU is present, else a CPU grid
    jax-flash-bench --json r.json --plot r.png      (or: python -m jax_flash.bench)

Timing follows ../shared/ANCHORS.md: the median of R rounds of C jitted calls after warm-up,
wall clock around block_until_ready; backward time = time(fwd + bwd) - time(fwd). Within a cell
the implementations take turns round by round (all compiled and warmed up first), so clock or
thermal drift during the cell falls on all of them alike instead of on whichever ran last, and
the turn order rotates from round to round (round r starts with the r-th implementation): the
board's power management moves the clock in waves of tens of milliseconds (4-6 calls of 12 ms in
session 44's traces), about one turn's length, so a fixed order meets each implementation at the
same phase every round (on an H100, swapping two implementations' places moved their 16k forward
short-round figures by 7-8%, cuda/sm90/NOTES.md session 44). Rotation costs nothing and treats
every implementation alike; on the grid's ratios it has measured as noise (session 45, H100: the
mean backward ratio of six H = 128 cells over two passes 0.988 rotated vs 0.989 fixed).
`--fixed-order` keeps the same order in every round (the method before session 44).
TFLOP/s counts 4*B*N*T*S*H for the forward (halved when causal), 2.5x that for the backward.
The fwd+bwd column (3.5x over time(fwd + bwd)) is the training step's figure without the
subtraction: a forward that times slower in one pass than in the other moves the backward figure
by the difference, not the total (cuda/sm90/NOTES.md, session 27).
Peak memory is XLA's compiled estimate (arguments + outputs + temporaries) of each call.

`--sustained SECONDS` adds a second view: after the rounds, each implementation runs its forward,
then its forward + backward, back to back for about SECONDS each, and nvidia-smi samples the SM
clock and board power meanwhile (GPU only). Short rounds catch the GPU in boost after the
host-side pauses between rounds; under sustained load an H200 runs attention at its 700 W cap
(1450-1950 MHz instead of 1980), so the clock the board grants a kernel weighs as much as the
kernel's cycles (cuda/sm90/NOTES.md, "Session 24"). Sustained figures also move far less
between runs than the rounds' medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import jax_flash


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _implementations(on_gpu):
    impls = {"jax_flash": lambda q, k, v, c: jax_flash.dot_product_attention(q, k, v, is_causal=c)}
    if on_gpu:
        impls["jax_flash_portable"] = lambda q, k, v, c: jax_flash.dot_product_attention(
            q, k, v, is_causal=c, implementation="portable")
        impls["cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn")
        try:
            from flash_attn3_jax import flash_mha  # the peer of ANCHORS.md, when installed

            impls["fa3_jax"] = lambda q, k, v, c: flash_mha(
                q, k, v, softmax_scale=1.0 / math.sqrt(q.shape[-1]), is_causal=c)
        except Exception:  # noqa: BLE001 - any import failure just means "not installed"
            pass
    impls["xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla")
    return impls


def _time_round(fn, args, calls):
    """Seconds per call over `calls` back-to-back calls (one timing round)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def _warm_up(fn, args):
    """Compiles fn and runs it once more, so timing starts warm."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))


def _time(fn, args, rounds, calls):
    """Median seconds per call of one function (after compilation and a warm-up call)."""
    _warm_up(fn, args)
    return statistics.median(_time_round(fn, args, calls) for _ in range(rounds))


def _peak_bytes(fn, args):
    try:
        m = fn.lower(*args).compile().memory_analysis()
        return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _error(e):
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}


class ClockSampler:
    """SM clock (MHz) and board power (W) sampled by nvidia-smi every 20 ms in the background.
    Without nvidia-smi (CPU machines) it samples nothing and every window reads None. Samples are
    read back only after close(): nvidia-smi buffers its output while it runs."""

    FIELDS = "timestamp,clocks.sm,power.draw"

    def __init__(self, enabled=True):
        self._proc, self._samples = None, []
        exe = shutil.which("nvidia-smi") if enabled else None
        if exe is None:
            return
        self._file = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([exe, f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                       "-lms", "20", "-i", "0"], stdout=self._file, stderr=subprocess.DEVNULL)

    def close(self):
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._file.seek(0)
        self._samples = [x for x in map(self._parse, self._file) if x is not None]
        self._file.close()
        self._proc = None

    @staticmethod
    def _parse(line):
        parts = [x.strip() for x in line.split(",")]
        try:  # local wall time, as time.time()
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            return t, float(parts[1]), float(parts[2])
        except (ValueError, IndexError):
            return None

    def window(self, t0, t1):
        """Mean (MHz, W) over [t0, t1] (time.time() seconds), leaving out its first tenth, where
        the board still reacts to what ran before; (None, None) without samples."""
        lo = t0 + 0.1 * (t1 - t0)
        s = [x for x in self._samples if lo <= x[0] <= t1]
        if not s:
            return None, None
        return statistics.mean(x[1] for x in s), statistics.mean(x[2] for x in s)


def _time_sustained(fn, args, seconds, per_call):
    """(seconds per call, wall-clock window) of about `seconds` of back-to-back calls."""
    calls = max(1, math.ceil(seconds / max(per_call, 1e-6)))
    t0, p0 = time.time(), time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - p0) / calls, (t0, time.time())


def cell_inputs(B, S, N, H, dtype):
    """q, k, v and the output cotangent of one cell: (B, S, N, H) normal samples in dtype."""
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(x, (B, S, N, H), jnp.float32).astype(dtype) for x in keys)


def timed_functions(impl, causal):
    """The two jitted calls a cell times: forward (q, k, v) and forward + backward (q, k, v, do)."""
    fwd = jax.jit(lambda q, k, v: impl(q, k, v, causal))
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: impl(q, k, v, causal), q, k, v)[1](do))
    return fwd, fwd_bwd


# FlashAttention's FLOP count: the backward is 2.5x the forward (five GEMMs against two).
BWD_FLOP_FACTOR = 2.5
FWD_BWD_FLOP_FACTOR = 1.0 + BWD_FLOP_FACTOR


def forward_flops(B, S, N, H, causal):
    """4*B*N*S*S*H, halved when causal (the backward counts BWD_FLOP_FACTOR times that)."""
    return 4 * B * N * S * S * H / (2 if causal else 1)


# The ANCHORS grid's fixed sizes: B*S tokens and N*H model width per cell.
GRID_TOKENS = 16384
GRID_MODEL_DIM = 2048


def grid_batch_heads(S, H, tokens=GRID_TOKENS, model_dim=GRID_MODEL_DIM):
    """(B, N) of a grid cell: B*S = tokens, N*H = model_dim (at least 1 each)."""
    return max(1, tokens // S), max(1, model_dim // H)


def grid_cell(spec, tokens=GRID_TOKENS, model_dim=GRID_MODEL_DIM):
    """'H:S:causal' (e.g. '128:4096:1') -> (B, S, N, H, causal) on the ANCHORS grid. The GPU probe
    tools (tools/trace_calls.py, kernel_times.py, dispatch_probe.py) name their cells this way."""
    H, S, causal = (int(x) for x in spec.split(":"))
    B, N = grid_batch_heads(S, H, tokens, model_dim)
    return B, S, N, H, bool(causal)


def run_cell(impls, B, S, N, H, causal, dtype, rounds, calls, measure_memory, sustained=0.0, rotate=True):
    """Times every implementation on one grid cell, interleaved: each is compiled and warmed up,
    then every round times each implementation's forward and forward + backward in turn (with
    rotate, round r starts at the r-th implementation and goes round).
    With sustained > 0, each implementation then runs its forward and forward + backward back to
    back for about `sustained` seconds each (results gain fwd_sus_tflops / bwd_sus_tflops and
    "_windows", the two runs' wall-clock spans, which main() turns into clock and power).
    Returns {name: result dict, or {"error": ...} for an implementation that failed}."""
    q, k, v, do = cell_inputs(B, S, N, H, dtype)
    results, ready = {}, {}
    for name, impl in impls.items():
        fwd, fwd_bwd = timed_functions(impl, causal)
        try:
            _warm_up(fwd, (q, k, v))
            _warm_up(fwd_bwd, (q, k, v, do))
            ready[name] = (fwd, fwd_bwd)
        except Exception as e:  # noqa: BLE001 - report and continue the grid
            results[name] = _error(e)
    samples = {name: ([], []) for name in ready}
    for r in range(rounds):
        order = list(ready)
        if rotate and order:
            order = order[r % len(order):] + order[:r % len(order)]
        for name in order:  # (a failure removes only the implementation being timed)
            fwd, fwd_bwd = ready[name]
            try:
                samples[name][0].append(_time_round(fwd, (q, k, v), calls))
                samples[name][1].append(_time_round(fwd_bwd, (q, k, v, do), calls))
            except Exception as e:  # noqa: BLE001
                results[name] = _error(e)
                del ready[name]
    flops = forward_flops(B, S, N, H, causal)
    for name, (fwd, fwd_bwd) in ready.items():
        t_f, t_fb = statistics.median(samples[name][0]), statistics.median(samples[name][1])
        res = {
            "fwd_ms": t_f * 1e3,
            "bwd_ms": (t_fb - t_f) * 1e3,
            "fwd_tflops": flops / t_f / 1e12,
            "bwd_tflops": BWD_FLOP_FACTOR * flops / max(t_fb - t_f, 1e-9) / 1e12,
            "fwdbwd_tflops": FWD_BWD_FLOP_FACTOR * flops / t_fb / 1e12,
        }
        if sustained > 0:
            (f_s, f_win), (fb_s, fb_win) = (_time_sustained(fn, args, sustained, t)
                                            for fn, args, t in ((fwd, (q, k, v), t_f), (fwd_bwd, (q, k, v, do), t_fb)))
            res["fwd_sus_tflops"] = flops / f_s / 1e12
            res["bwd_sus_tflops"] = BWD_FLOP_FACTOR * flops / max(fb_s - f_s, 1e-9) / 1e12
            res["_windows"] = (f_win, fb_win)
        if measure_memory(name):
            res["fwd_peak_mb"] = (_peak_bytes(fwd, (q, k, v)) or 0) / 2**20
            res["fwd_bwd_peak_mb"] = (_peak_bytes(fwd_bwd, (q, k, v, do)) or 0) / 2**20
        results[name] = res
    return {name: results[name] for name in impls if name in results}


def _positive(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def _non_negative(text):
    x = float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return x


def main(argv=None):
    on_gpu = _has_gpu()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=_positive, nargs="+", default=[64, 128, 256] if on_gpu else [64])
    p.add_argument("--seqlens", type=_positive, nargs="+", default=[1024, 4096, 16384] if on_gpu else [4096])
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both" if on_gpu else "no")
    p.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"],
                   default=["bfloat16", "float16"] if on_gpu else ["float32"])
    p.add_argument("--tokens", type=_positive, default=GRID_TOKENS, help="B*S (GPU grid)")
    p.add_argument("--model-dim", type=_positive, default=GRID_MODEL_DIM, help="N*H (GPU grid)")
    p.add_argument("--batch", type=_positive, default=None, help="fixed B (default tokens // S)")
    p.add_argument("--heads", type=_positive, default=None, help="fixed N (default model_dim // H)")
    p.add_argument("--impls", nargs="+", default=None, help="subset of implementations to run")
    p.add_argument("--rounds", type=_positive, default=7 if on_gpu else 3)
    p.add_argument("--calls", type=_positive, default=10 if on_gpu else 1)
    p.add_argument("--fixed-order", action="store_true",
                   help="time the implementations in the same order every round (default: rotate)")
    p.add_argument("--sustained", type=_non_negative, default=0.0, metavar="SECONDS",
                   help="also time SECONDS of back-to-back calls per implementation and pass, with the "
                        "SM clock and power (GPU) alongside (default 0: off)")
    p.add_argument("--xla-max-gb", type=float, default=8.0, help="skip XLA when its logits exceed this")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    a = p.parse_args(argv)
    if not on_gpu and a.batch is None and a.heads is None and a.tokens == GRID_TOKENS:
        a.batch, a.heads = 1, 2  # CPU default: one sequence, two heads

    impls = _implementations(on_gpu)
    if a.impls:
        unknown = sorted(set(a.impls) - set(impls))
        if unknown:
            p.error(f"--impls: {', '.join(unknown)} not available here (available: {', '.join(impls)})")
        impls = {n: f for n, f in impls.items() if n in a.impls}
    causals = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
    print(f"# jax_flash benchmark on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}; implementations: {', '.join(impls)}", flush=True)
    rows = []
    sampler = ClockSampler(enabled=on_gpu and a.sustained > 0)
    for dtype in a.dtypes:
        for H in a.head_dims:
            for S in a.seqlens:
                for causal in causals:
                    B, N = grid_batch_heads(S, H, a.tokens, a.model_dim)
                    B, N = a.batch or B, a.heads or N
                    row = {"dtype": dtype, "H": H, "S": S, "B": B, "N": N, "causal": causal, "results": {}}
                    cell = {n: f for n, f in impls.items()
                            if not (n == "xla" and B * N * S * S * 4 > a.xla_max_gb * 1e9)}
                    row["results"] = run_cell(cell, B, S, N, H, causal, jnp.dtype(dtype), a.rounds, a.calls,
                                              measure_memory=lambda n: not on_gpu or n == "jax_flash",
                                              sustained=a.sustained, rotate=not a.fixed_order)
                    rows.append(row)
                    _print_row(row, impls)
    sampler.close()
    for row in rows:
        for r in row["results"].values():
            if "_windows" in r:
                (r["fwd_mhz"], r["fwd_w"]), (r["fwd_bwd_mhz"], r["fwd_bwd_w"]) = map(
                    lambda w: sampler.window(*w), r.pop("_windows"))
    _print_table(rows, impls)
    if a.sustained > 0:
        _print_sustained(rows, impls, a.sustained)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    if a.plot:
        _plot(rows, impls, a.plot)
    return 0


def _best_other(row, key):
    others = [r[key] for n, r in row["results"].items()
              if not n.startswith("jax_flash") and key in r]
    return max(others) if others else None


def _num(x):
    # Whole TFLOP/s on GPUs; three significant digits for the CPU's fractions of one.
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.3g}"


def _fmt(r, key):
    if r is None:
        return "-"
    if "error" in r:
        return "err"
    return _num(r[key]) if key in r else "-"


def _print_row(row, impls):
    parts = [f"{n}: " + ("err " + row['results'][n]['error'] if 'error' in row['results'][n] else
                         f"fwd {_num(row['results'][n]['fwd_tflops'])} bwd {_num(row['results'][n]['bwd_tflops'])}")
             for n in impls if n in row["results"]]
    print(f"  {row['dtype']} H={row['H']} S={row['S']} B={row['B']} N={row['N']} causal={row['causal']}: "
          + " | ".join(parts), file=sys.stderr, flush=True)


def _print_ratio_table(title, rows, names, keys, cell, labels=("fwd", "bwd")):
    """One markdown table: per row each implementation's figures for the keys (labelled by labels)
    as cell(result or None, key) formats them, then jax_flash / the best other for each key."""
    head = ["dtype", "H", "S", "causal"] + [f"{n} {d}" for n in names for d in labels]
    head += [f"{d} x best" for d in labels]
    print(title)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        cells = [row["dtype"], str(row["H"]), str(row["S"]), "yes" if row["causal"] else "no"]
        for n in names:
            r = row["results"].get(n)
            cells += [cell(r, key) for key in keys]
        ours = next((r for n, r in row["results"].items() if n.startswith("jax_flash")), {})
        for key in keys:
            best = _best_other(row, key)
            cells.append(f"{ours[key] / best:.2f}" if best and key in ours else "-")
        print("| " + " | ".join(cells) + " |")


def _print_table(rows, impls):
    _print_ratio_table("\nTFLOP/s (x best = jax_flash / best other implementation in this run)", rows, list(impls),
                       ("fwd_tflops", "bwd_tflops", "fwdbwd_tflops"), _fmt, labels=("fwd", "bwd", "fwd+bwd"))
    if any("fwd_peak_mb" in r for row in rows for r in row["results"].values()):
        print("\nTime (ms) and XLA-estimated peak memory (MiB)")
        print("| dtype | H | S | causal | impl | fwd ms | bwd ms | fwd peak MiB | fwd+bwd peak MiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            for n, r in row["results"].items():
                if "fwd_peak_mb" in r:
                    print(f"| {row['dtype']} | {row['H']} | {row['S']} | {'yes' if row['causal'] else 'no'} | {n} | "
                          f"{r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['fwd_peak_mb']:.0f} | {r['fwd_bwd_peak_mb']:.0f} |")


def _print_sustained(rows, impls, seconds):
    names = [n for n in impls if any("fwd_sus_tflops" in row["results"].get(n, {}) for row in rows)]
    clock_of = {"fwd_sus_tflops": "fwd_mhz", "bwd_sus_tflops": "fwd_bwd_mhz"}

    def cell(r, key):
        if r is None or key not in r:
            return "-"
        mhz = r.get(clock_of[key])
        return _num(r[key]) + (f" @{mhz:.0f}" if mhz is not None else "")

    _print_ratio_table(f"\nSustained: about {seconds:g} s of back-to-back calls per implementation and pass; "
                       "TFLOP/s @ mean SM clock in MHz (forward; forward + backward for bwd)",
                       rows, names, ("fwd_sus_tflops", "bwd_sus_tflops"), cell)


def _plot(rows, impls, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["H"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 2.6 * len(groups)), squeeze=False)
    for gi, g in enumerate(groups):
        sub = [r for r in rows if (r["dtype"], r["H"], r["causal"]) == g]
        for ci, key in enumerate(("fwd_tflops", "bwd_tflops")):
            ax = axes[gi][ci]
            for n in impls:
                xs = [r["S"] for r in sub if key in r["results"].get(n, {})]
                ys = [r["results"][n][key] for r in sub if key in r["results"].get(n, {})]
                if xs:
                    ax.plot(xs, ys, marker="o", label=n)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{g[0]} H={g[1]} causal={g[2]} {key.split('_')[0]}")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
