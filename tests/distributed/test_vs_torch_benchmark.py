"""benchmarks/vs_torch_pipelining.py runs end to end at a tiny size (2 gloo ranks, seconds)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import vs_torch_pipelining  # noqa: E402


def test_quick_run_compares_every_schedule_on_both_sides(capsys):
    assert vs_torch_pipelining.main(["--quick"]) == 0
    text = capsys.readouterr().out
    for label in ("ours 1f1b", "ours chimera direct eager-opt", "ours chimera backward-halving",
                  "torch Schedule1F1B", "torch ScheduleZBVZeroBubble"):
        assert label in text, label
    assert "not run: torch ScheduleDualPipeV" in text  # N = 2 < 2D: PyTorch refuses it
    assert "ours / plain" in text and "our 1F1B / torch 1F1B" in text
