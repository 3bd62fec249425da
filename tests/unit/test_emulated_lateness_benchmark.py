"""benchmarks/emulated_lateness.py: a tiny gloo run (D = 4, N = 8, 2 ms units) aligns every rank's
measured ops with the simulator's timeline of the same plan and splits the critical path's
lateness into its terms; the timer-slack helper sets and restores the thread's slack."""

from __future__ import annotations

import os
import re
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import _emulated_stages  # noqa: E402
import emulated_lateness  # noqa: E402


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl timer slack is Linux's")
def test_timer_slack_is_set_and_the_previous_value_returned():
    previous = _emulated_stages.set_timer_slack(1000)
    try:
        assert _emulated_stages.set_timer_slack(2000) == 1000
    finally:
        _emulated_stages.set_timer_slack(previous)


@pytest.mark.distributed
def test_a_tiny_run_splits_the_critical_path(capsys):
    assert emulated_lateness.main(["--unit-ms", "2", "--iterations", "1", "--only",
                                   "chimera split", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "ours chimera split: simulated 50.0 ms" in out  # 25 units of 2 ms
    line = next(line for line in out.splitlines() if "critical path" in line)
    late, *terms = (float(value) for value in re.findall(r"(-?\d+\.\d+)", line)[:7])
    assert late == pytest.approx(sum(terms), abs=0.3)  # the terms add up (rounded to 0.1 ms)
    assert "tail: last op end -> iteration end" in out
    assert "path: r" in out
