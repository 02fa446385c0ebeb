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
