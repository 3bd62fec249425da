"""Smoke (tier 3): a stalled rank (SIGSTOP) under torchrun ends the whole run, with a non-zero
status, within the distributed timeout plus torchrun's grace, and the waiting rank's error names
the group and the peer it waited for. One launch through tools/stress.py with a 6 s timeout (the
10-launch, 1-minute campaign of docs/reliability.md is the same command with other numbers)."""

import json
import os
import subprocess
import sys

import pytest

from torchrun_helpers import REPO

pytestmark = pytest.mark.smoke


def test_a_stopped_rank_ends_the_run_with_a_named_timeout(tmp_path):
    report_path = tmp_path / "report.json"
    command = [sys.executable, os.path.join(REPO, "tools", "stress.py"), "--launches", "1",
               "--nproc", "2", "--preset", "chimera-pp2-eager-opt", "--fault", "stop",
               "--fault-after", "1", "--distributed-timeout-minutes", "0.1", "--grace", "50",
               "--train-iters", "5000", "--launch-timeout", "150", "--json", str(report_path)]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-2000:]
    (launch,) = json.loads(report_path.read_text())["outcomes"]
    assert launch["fault_injected"] and launch["returncode"] not in (0, None)
    assert launch["ended_after_fault_s"] <= 6 + 50
    named = [line for line in launch["error_lines"] if "CommunicationTimeout: " in line]
    assert named, launch["error_lines"]
    assert "timed out waiting for" in named[0] and "waiting for global rank(s) [1]" in named[0]
