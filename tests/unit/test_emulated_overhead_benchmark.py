"""benchmarks/emulated_overhead.py: a tiny gloo run (D = 4, N = 8, 2 ms units) splits every rank's
iteration into CPU, run delay, sleep overshoot and all-reduce wait, per op kind and per hop."""

from __future__ import annotations

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import emulated_overhead  # noqa: E402


def test_recording_clock_records_what_was_asked_and_slept():
    clock = emulated_overhead.RecordingClock()
    clock.sleep(0.001)
    ((asked, slept),) = clock.sleeps
    assert asked == 0.001 and slept >= 0.001


@pytest.mark.distributed
def test_a_tiny_run_reports_ops_hops_and_the_torch_side(capsys):
    assert emulated_overhead.main(["--unit-ms", "2", "--iterations", "1", "--only",
                                   "chimera split", "--torch", "Schedule1F1B"]) == 0
    out = capsys.readouterr().out
    assert "== ours chimera split: iteration" in out and "measured / simulated" in out
    for kind in ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "P2PGroup", "GradSyncStart"):
        assert kind in out
    assert "waited for" in out or "hops:" not in out  # hop line only when a consumer waited
    assert "== torch Schedule1F1B: iteration" in out
