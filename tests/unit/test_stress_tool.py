"""tools/stress.py without launching anything: options, command, expectations and the report."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("stress", os.path.join(REPO, "tools", "stress.py"))
stress = importlib.util.module_from_spec(_spec)
sys.modules["stress"] = stress  # dataclasses look their module up there
_spec.loader.exec_module(stress)


def _outcome(returncode, wall=10.0, aborted=False, met=True):
    return stress.LaunchOutcome(returncode=returncode, wall_s=wall, aborted_at_exit=aborted,
                                finished_training=returncode == 0, met_expectation=met)


def test_command_carries_preset_timeout_and_extra_flags():
    options = stress.parse_options(["--preset", "chimera-pp2-end", "--launches", "3",
                                    "--distributed-timeout-minutes", "0.5", "--", "--fp16"])
    command = stress.build_command(options)
    joined = " ".join(command)
    assert "--pipeline-schedule chimera --chimera-grad-sync end" in joined
    assert "--distributed-timeout-minutes 0.5" in joined and command[-1] == "--fp16"
    assert {"1f1b-pp2", "1f1b-pp4", "interleaved-pp2", "interleaved-pp4",
            "chimera-pp4-eager"} <= set(stress.PRESETS)


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        stress.parse_options(["--fault", "stop", "--fault-rank", "2", "--nproc", "2"])
    with pytest.raises(SystemExit):
        stress.parse_options(["--launches", "0"])


def test_expectations_per_fault():
    assert stress._expected("none", 0, True, 20, 0)
    assert not stress._expected("none", 0, False, 20, 0)  # exited 0 without finishing
    assert not stress._expected("none", 1, True, 20, 0)   # e.g. SIGABRT at exit
    assert stress._expected("stop", 1, False, 80, 90)
    assert not stress._expected("stop", 1, False, 100, 90)  # ended, but too late
    assert not stress._expected("stop", None, False, 300, 90)  # hang
    assert not stress._expected("kill", 0, True, 20, 90)
    assert not stress._expected("stop", 1, False, None, 90)  # the fault was never injected


def test_report_counts_statuses_hangs_and_aborts():
    report = stress.summarize([_outcome(0, 10), _outcome(1, 30, aborted=True, met=False),
                               _outcome(None, 300, met=False), _outcome(0, 20)])
    assert report["exit_statuses"] == {"0": 2, "1": 1, "hang": 1}
    assert (report["hangs"], report["aborted_at_exit"], report["met_expectation"]) == (1, 1, 2)
    assert report["wall_s"] == {"min": 10, "median": 25.0, "max": 300}
    assert report["ended_after_fault_s"] == {}  # no fault injected


def test_report_gives_the_time_from_the_signal_to_the_end():
    outcomes = [_outcome(1, 100), _outcome(1, 110)]
    outcomes[0].ended_after_fault_s, outcomes[1].ended_after_fault_s = 88.5, 92.0
    assert stress.summarize(outcomes)["ended_after_fault_s"] == {"min": 88.5, "median": 90.25,
                                                                 "max": 92.0}
