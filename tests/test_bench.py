"""The benchmark's command line (not its timings): a tiny CPU grid runs and writes its JSON, and
bad arguments stop it with a usage error instead of garbage rows."""

import json
import os
import time

import pytest

from jax_flash import bench


def test_tiny_grid_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--seqlens", "32", "--head-dims", "16", "--dtypes", "float32", "--impls", "jax_flash",
                       "--rounds", "1", "--batch", "1", "--heads", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["H"], r["S"]) for r in rows] == [(16, 32)]
    r = rows[0]["results"]["jax_flash"]
    assert r["fwd_ms"] > 0
    # fwd+bwd counts 3.5x the forward's FLOPs over the whole training step's time
    flops = 4 * 1 * 2 * 32 * 32 * 16
    assert r["fwdbwd_tflops"] == pytest.approx(3.5 * flops / ((r["fwd_ms"] + r["bwd_ms"]) * 1e-3) / 1e12)
    text = capsys.readouterr().out
    assert "| float32 | 16 | 32 | no |" in text and "| fwd+bwd x best |" in text


@pytest.mark.parametrize("args", [
    ["--head-dims", "0"], ["--seqlens", "-1"], ["--rounds", "0"], ["--dtypes", "int8"],
    ["--impls", "no_such_impl"], ["--sustained", "-1"], ["--sustained", "nan"],
])
def test_bad_arguments_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cell_interleaves_implementations_and_reports_failures(monkeypatch):
    """Every implementation is timed once per round, in turn (drift hits all alike); one that fails
    to compile is reported as an error row entry without stopping the others."""
    import jax
    import jax.numpy as jnp

    calls = []

    def fake_round(fn, args, n):
        calls.append((fn, len(args)))  # 3 args: forward, 4: forward + backward
        return 1e-3

    monkeypatch.setattr(bench, "_time_round", fake_round)

    def broken(q, k, v, causal):
        raise ValueError("no kernel for this")

    impls = {"a": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c),
             "bad": broken,
             "b": lambda q, k, v, c: 2.0 * jax.nn.dot_product_attention(q, k, v, is_causal=c)}
    res = bench.run_cell(impls, 1, 16, 2, 8, False, jnp.dtype("float32"), rounds=3, calls=1,
                         measure_memory=lambda n: False, rotate=False)
    assert list(res) == ["a", "bad", "b"]
    assert res["bad"]["error"].startswith("ValueError: no kernel")
    assert res["a"]["fwd_ms"] == pytest.approx(1.0) and res["b"]["bwd_ms"] == pytest.approx(0.0)
    fns = [fn for fn, _ in calls]
    assert [n for _, n in calls] == [3, 4] * 6
    # a's pair, then b's pair, in each of the three rounds
    assert fns[0:4] * 3 == fns and len({id(f) for f in fns[0:4]}) == 4

    # Rotated (the default): round r starts with the r-th implementation that compiled.
    calls.clear()
    res = bench.run_cell(impls, 1, 16, 2, 8, False, jnp.dtype("float32"), rounds=3, calls=1,
                         measure_memory=lambda n: False)
    assert list(res) == ["a", "bad", "b"]
    fns = [fn for fn, _ in calls]
    a_pair, b_pair = fns[0:2], fns[2:4]
    assert fns == a_pair + b_pair + b_pair + a_pair + a_pair + b_pair
    assert len({id(f) for f in a_pair + b_pair}) == 4


def test_sustained_view_adds_its_figures_and_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--seqlens", "32", "--head-dims", "16", "--dtypes", "float32", "--impls", "jax_flash", "xla",
                       "--rounds", "1", "--batch", "1", "--heads", "2", "--sustained", "0.05", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["rows"][0]["results"]
    for r in res.values():
        assert r["fwd_sus_tflops"] > 0 and "bwd_sus_tflops" in r and "_windows" not in r
        assert r["fwd_mhz"] is None  # no GPU, no clock samples
    text = capsys.readouterr().out
    assert "Sustained: about 0.05 s" in text
    assert text.split("Sustained:")[1].count("| float32 | 16 | 32 | no |") == 1


def test_clock_sampler_averages_the_window(tmp_path, monkeypatch):
    """The sampler parses nvidia-smi's CSV (local timestamps) and averages only the samples inside
    a window, leaving out its first tenth. A stand-in nvidia-smi prints 1500 MHz, then 1700."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/bash\nclk=1500\nwhile true; do [ -e " + str(tmp_path / "switch") + " ] && clk=1700\n"
                    "  echo \"$(date '+%Y/%m/%d %H:%M:%S.%3N'), $clk, 690.5\"; sleep 0.01; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    sampler = bench.ClockSampler()
    time.sleep(0.6)
    t_switch = time.time()
    (tmp_path / "switch").touch()
    time.sleep(0.3)  # the stand-in notices the switch within a loop turn (~10 ms)
    t0 = time.time()
    time.sleep(0.4)
    t1 = time.time()
    sampler.close()
    assert sampler.window(t0, t1) == (pytest.approx(1700), pytest.approx(690.5))
    mhz, _ = sampler.window(t_switch - 0.3, t_switch - 0.05)
    assert mhz == pytest.approx(1500)
    assert sampler.window(t1 + 10, t1 + 11) == (None, None)


@pytest.mark.parametrize("spec, cell", [
    ("128:4096:1", (4, 4096, 16, 128, True)),
    ("256:16384:0", (1, 16384, 8, 256, False)),
    ("64:1024:0", (16, 1024, 32, 64, False)),
])
def test_grid_cell_names_the_anchors_grid(spec, cell):
    """The GPU probe tools' 'H:S:causal' cells: B*S = 16k tokens and N*H = 2048, as the grid."""
    assert bench.grid_cell(spec) == cell
