"""The benchmark's command line (not its timings): a tiny CPU grid runs and writes its JSON, and
bad arguments stop it with a usage error instead of garbage rows."""

import json

import pytest

from jax_flash import bench


def test_tiny_grid_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--seqlens", "32", "--head-dims", "16", "--dtypes", "float32", "--impls", "jax_flash",
                       "--rounds", "1", "--batch", "1", "--heads", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["H"], r["S"]) for r in rows] == [(16, 32)]
    assert rows[0]["results"]["jax_flash"]["fwd_ms"] > 0
    assert "| float32 | 16 | 32 | no |" in capsys.readouterr().out


@pytest.mark.parametrize("args", [
    ["--head-dims", "0"], ["--seqlens", "-1"], ["--rounds", "0"], ["--dtypes", "int8"],
    ["--impls", "no_such_impl"],
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
                         measure_memory=lambda n: False)
    assert list(res) == ["a", "bad", "b"]
    assert res["bad"]["error"].startswith("ValueError: no kernel")
    assert res["a"]["fwd_ms"] == pytest.approx(1.0) and res["b"]["bwd_ms"] == pytest.approx(0.0)
    fns = [fn for fn, _ in calls]
    assert [n for _, n in calls] == [3, 4] * 6
    # a's pair, then b's pair, in each of the three rounds
    assert fns[0:4] * 3 == fns and len({id(f) for f in fns[0:4]}) == 4
