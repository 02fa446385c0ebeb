"""C++ helpers of cuda/common checked by small programs: the mask helpers the sm90 kernels hoist
out of their loops (mask.h) against element-by-element visibility (tests/cpp/test_mask.cc), and
the rules by which the CUDA handlers route optional inputs to the Hopper or the portable kernels
(flash_params.h; tests/cpp/test_routing.cc), and the Hopper tile schedule's index arithmetic
(sm90/scheduler.h; tests/cpp/test_scheduler.cc)."""

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
