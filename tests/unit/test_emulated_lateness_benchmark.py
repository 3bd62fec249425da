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


def test_thread_table_charges_each_poll_to_its_window():
    import _thread_cpu
    ms = 1_000_000  # ns
    samples = [  # (time, pid, tid, kind, cpu ns, run-queue ns)
        (0.00, 10, 10, "main", 0, 0), (0.00, 10, 11, "gloo_tcp_loop", 0, 0),
        (0.05, 10, 10, "main", 20 * ms, 4 * ms), (0.05, 10, 11, "gloo_tcp_loop", 5 * ms, 0),
        (0.15, 10, 10, "main", 30 * ms, 6 * ms), (0.15, 10, 11, "gloo_tcp_loop", 5 * ms, 9 * ms),
        (0.25, 10, 10, "main", 90 * ms, 6 * ms),  # after the end: not charged
    ]
    overruns = [(0.01, 0.002, "F"), (0.09, 0.004, "W"), (0.12, 0.001, "W")]
    lines = _thread_cpu.window_table(samples, 0.0, 0.2, 2, overruns)
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 2
    # window 0: main 20 ms of CPU in 100 ms, the loop 5 ms; main queued 4 ms; ops 2 and 4 ms (W 4)
    assert rows[0][1:5] == ["0.20", "0.05", "0.00", "0.00"]
    assert rows[0][5:] == ["4.00", "3.00", "/", "4.00"]
    # window 1: main 10 ms, the loop none (its run-queue time is not a main thread's)
    assert rows[1][1:5] == ["0.10", "0.00", "0.00", "0.00"]
    assert rows[1][5:] == ["2.00", "1.00", "/", "1.00"]


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_tiny_run_reports_the_ranks_threads(capsys):
    # 20 ms units: the iteration lasts ~0.5 s, many of the sampler's 20 ms polls (2 ms units
    # ended the iteration within one or two polls, and the windows could see no CPU at all)
    assert emulated_lateness.main(["--unit-ms", "20", "--iterations", "1", "--only",
                                   "chimera split", "--thread-cpu", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if "threads (cores used" in line)
    rows = [line.split() for line in out[header + 2:header + 4]]
    assert len(rows) == 2 and all("-" in row[0] and len(row) == 9 for row in rows)
    # the four ranks' main threads ran during the iteration
    assert sum(float(row[1]) for row in rows) > 0
