"""tools/trace_calls.py's reading of a profiler trace (the GPU run itself is not tested here):
how a loop's kernel events split into calls, what a call's span and idle share are, and the
backward column taken from the two loops' spans."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "tools", "trace_calls.py")
_spec = importlib.util.spec_from_file_location("trace_calls", _PATH)
tc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tc)


def _loop(kernels, n_calls, period, t0=0.0, one_off=()):
    """Kernel events of n_calls calls, each launching `kernels` ((name, start offset, duration))
    at t0 + i * period; `one_off` events come first (e.g. a first call's extra work)."""
    ev = [{"name": n, "ts": t0 - 50.0 + s, "dur": d} for n, s, d in one_off]
    for i in range(n_calls):
        ev += [{"name": n, "ts": t0 + i * period + s, "dur": d} for n, s, d in kernels]
    return ev


def test_calls_split_by_the_repeating_launch_sequence():
    call = [("void ns::fwd<T>(P)", 0.0, 60.0), ("bwd", 60.0, 30.0)]
    ev = _loop(call, 4, 100.0, one_off=[("memset", 0.0, 5.0)])
    calls = tc._calls(ev, 4)
    assert [len(c) for c in calls] == [2, 2, 2, 2]
    assert [c[0]["ts"] for c in calls] == [0.0, 100.0, 200.0, 300.0]  # the one-off event is left out
    assert tc._calls(ev[:-1], 4) is None  # an incomplete last call: no period fits


def test_summary_span_idle_and_kernel_medians():
    # Two kernels, the second overlapping the first by 10 us (a programmatic dependent launch):
    # busy 80 of a 100 us period, so 20% idle; the kernel sum counts the overlap twice (90).
    call = [("fwd", 0.0, 60.0), ("convert", 50.0, 30.0)]
    r = tc._summary(_loop(call, 5, 100.0), 5)
    assert r["span"] == pytest.approx(100.0)
    assert r["idle"] == pytest.approx(0.2)
    assert r["sum"] == pytest.approx(90.0)
    assert r["kernels"] == [("fwd", 60.0), ("convert", 30.0)]
    assert r["longest"] == ("fwd", 60.0, 60.0)
    assert "error" in tc._summary(_loop(call, 3, 100.0), 5)


def test_backward_from_spans():
    assert tc.backward_from_spans({"fwd": 3000.0, "fwd+bwd": 12400.0}) == pytest.approx(9400.0)
    assert tc.backward_from_spans({"fwd": 3000.0}) is None  # the fwd+bwd loop failed to read
    assert tc.backward_from_spans({"fwd": 3000.0, "fwd+bwd": 2900.0}) is None


def test_short_names():
    assert tc._short("void jax_flash::sm90::flash_bwd_kernel<Traits, true>(Params)") == "flash_bwd_kernel"
