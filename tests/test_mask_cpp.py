"""The mask helpers the sm90 kernels hoist out of their loops (cuda/common/mask.h), checked by a
small C++ program against element-by-element visibility (tests/cpp/test_mask.cc)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_seq_mask_tile_helpers(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "test_mask"
    subprocess.run([cxx, "-std=c++17", "-O2", "-I", str(ROOT / "cuda"), str(ROOT / "tests/cpp/test_mask.cc"),
                    "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 mismatches" in out.stdout
