"""C++ helpers of cuda/common checked by small programs: the mask helpers the sm90 kernels hoist
out of their loops (mask.h) against element-by-element visibility (tests/cpp/test_mask.cc), and
the rules by which the CUDA handlers route optional inputs to the Hopper or the portable kernels
(flash_params.h; tests/cpp/test_routing.cc), the Hopper tile schedule's index arithmetic
(sm90/scheduler.h; tests/cpp/test_scheduler.cc), and the dQ accumulator's padded shape, which
Python mirrors to size the FFI output (tests/cpp/test_dq_accum.cc)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_and_run(tmp_path, name):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / name
    subprocess.run([cxx, "-std=c++17", "-O2", "-I", str(ROOT / "cuda"), str(ROOT / f"tests/cpp/{name}.cc"),
                    "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_seq_mask_tile_helpers(tmp_path):
    assert "0 mismatches" in build_and_run(tmp_path, "test_mask")


def test_hopper_routing_of_optional_inputs(tmp_path):
    """Segment ids: Hopper forward and backward (not softcap / deterministic backward); mask:
    Hopper forward; bias: Hopper forward above head dim 64 only; dropout: portable."""
    assert "0 routing failures" in build_and_run(tmp_path, "test_routing")


def test_tile_schedule_index_arithmetic(tmp_path):
    """get_tile's multiply-high divisions give the schedule's (block, head, batch) for every tile."""
    assert " 0 mismatches" in build_and_run(tmp_path, "test_scheduler")


def test_dq_accum_shape_mirrors_cpp(tmp_path):
    """_dq_accum_shape (the FFI output's size) equals dq_accum_rows / dq_accum_cols for every length
    and head dim the program prints: a smaller buffer would be refused by the launch checks."""
    from jax_flash._primitives import _dq_accum_shape

    lines = build_and_run(tmp_path, "test_dq_accum").split()
    got = {(lines[i], int(lines[i + 1])): int(lines[i + 2]) for i in range(0, len(lines), 3)}
    got = {key: want for key, want in got.items() if not key[0].startswith("bwd_ws")}
    assert len(got) == 2000 + 320
    for (kind, n), want in got.items():
        shape = _dq_accum_shape(1, 1, n, 64) if kind == "rows" else _dq_accum_shape(1, 1, 1, n)
        assert shape[2 if kind == "rows" else 3] == want, (kind, n)


def test_bwd_workspace_mirrors_cpp(tmp_path):
    """_bwd_workspace_ints (the Hopper backward's int32 FFI output) equals bwd_workspace_ints for a
    launch that may split its last round (non-causal, enough query rows): a smaller buffer would
    silently turn the split tail off (the handler passes only a workspace of the full size)."""
    from types import SimpleNamespace

    from jax_flash._primitives import _bwd_workspace_ints

    plain = SimpleNamespace(extras=(), window_left=-1, window_right=-1, causal=False, deterministic=False)
    lines = build_and_run(tmp_path, "test_dq_accum").split()
    rows = [(lines[i], int(lines[i + 1]), int(lines[i + 2])) for i in range(0, len(lines), 3)]
    rows = [r for r in rows if r[0].startswith("bwd_ws")]
    assert len(rows) == 6 * 207 and any(want > 1 for *_, want in rows) and any(want == 1 for *_, want in rows)
    for kind, s, want in rows:
        b, k = map(int, kind.split("_")[2:])
        assert _bwd_workspace_ints(plain, b, k, k, 4096, s) == want, (b, k, s)

