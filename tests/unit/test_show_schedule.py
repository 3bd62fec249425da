"""Tier 0: tools/show_schedule.py writes every format."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron.core.pipeline_parallel.planning.instructions import parse_schedule_csv
from megatron.core.pipeline_parallel.planning.schedules import build_schedule

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOOL = os.path.join(ROOT, "tools", "show_schedule.py")


@pytest.fixture(scope="module")
def show_schedule():
    spec = importlib.util.spec_from_file_location("show_schedule", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed  # starts a process
def test_done_when_command_prints_the_d4_grid():
    output = subprocess.run(
        [sys.executable, TOOL, "--schedule", "chimera", "--pipeline-model-parallel-size", "4",
         "--num-microbatches", "4", "--backward-cost", "2"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    lines = output.splitlines()
    assert lines[1].split() == ["P0:", "F0v", "F1v", ".", "F2^", "B2^", "B2^", "F3^", "B3^",
                                "B3^", ".", "B0v", "B0v", ".", ".", "B1v", "B1v"]
    assert "makespan 16" in lines
    assert "bubble ratio 0.2500" in lines
    assert lines[-1].endswith(": 3 4 4 3")


def test_csv_round_trips_to_the_schedule(show_schedule, tmp_path):
    path = tmp_path / "schedule.csv"
    show_schedule.main(["--schedule", "chimera", "--pipeline-model-parallel-size", "6",
                        "--num-microbatches", "12", "--chimera-variant", "forward-doubling",
                        "--format", "csv", "--output", str(path)])
    assert parse_schedule_csv(path.read_text()) == build_schedule(
        "chimera", 6, 12, variant="forward-doubling")
    assert len(path.read_text().splitlines()) == 6  # one row per rank


def test_json_is_a_chrome_trace(show_schedule, tmp_path):
    path = tmp_path / "trace.json"
    show_schedule.main(["--schedule", "interleaved-1f1b", "--pipeline-model-parallel-size", "4",
                        "--num-microbatches", "8", "--num-model-chunks", "2", "--format", "json",
                        "--output", str(path)])
    trace = json.loads(path.read_text())
    compute = [e for e in trace["traceEvents"] if e.get("cat") in ("forward", "backward")]
    assert len(compute) == 4 * 8 * 2 * 2
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in compute)
    assert {e["tid"] for e in compute} == {0, 1, 2, 3}
    assert trace["otherData"]["makespan"] > 0


@pytest.mark.distributed  # starts a process
def test_png_is_written(show_schedule, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    show_schedule.main(["--schedule", "chimera", "--pipeline-model-parallel-size", "4",
                        "--num-microbatches", "8", "--chimera-pipelines", "4", "--format", "png",
                        "--output", str(path)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_for_other_schedules(show_schedule, capsys):
    show_schedule.main(["--schedule", "1f1b", "--pipeline-model-parallel-size", "4",
                        "--num-microbatches", "8"])
    output = capsys.readouterr().out
    assert "makespan 33" in output  # (N + D - 1)(F + Bk) = 11 * 3
    assert "peak activations per rank (micro-batches): 4 3 2 1" in output
    show_schedule.main(["--schedule", "chimera", "--pipeline-model-parallel-size", "4",
                        "--num-microbatches", "4", "--chimera-variant", "backward-halving"])
    output = capsys.readouterr().out
    assert "one column = 0.5 time units" in output and "half micro-batches" in output


def test_bad_options_exit_with_the_allowed_values(show_schedule, capsys):
    with pytest.raises(SystemExit):
        show_schedule.main(["--schedule", "chimera", "--pipeline-model-parallel-size", "6",
                            "--num-microbatches", "6", "--chimera-pipelines", "4"])
    assert "allowed --chimera-pipelines for D = 6: 2, 6" in capsys.readouterr().err
