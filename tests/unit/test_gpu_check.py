"""benchmarks/gpu_check.sh: it parses (bash -n), its loss comparison reads pretrain_gpt.py's log
lines, and its CPU dry mode (GPU_CHECK_DEVICE=cpu, tiny sizes) runs every step to the end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
LOG_LINE = (" [2026-11-30 07:18:29] iteration        {i}/       5 | consumed samples:           16 | "
            "elapsed time per iteration (ms): 264.0 | learning rate: 8.000000E-04 | global batch "
            "size:    16 | lm loss: {loss} | loss scale: 1.0 | grad norm: 1.030 |\n")


@pytest.fixture(scope="module")
def helper():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed  # starts a process
def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_loss_comparison_reads_the_log_lines(helper, tmp_path):
    first, second, out = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "c.json"
    first.write_text("".join(LOG_LINE.format(i=i, loss=f"{6.9 - i / 10:.6E}") for i in (1, 2, 3)))
    second.write_text("".join(LOG_LINE.format(i=i, loss=f"{(6.9 - i / 10) * (1 + 1e-5):.6E}")
                              for i in (1, 2, 3)))
    assert helper.logged_losses(str(first)) == pytest.approx({1: 6.8, 2: 6.7, 3: 6.6})
    assert helper.compare_losses(str(first), str(second), str(out), rtol=1e-4) == 0
    assert json.loads(out.read_text())["ok"]
    assert helper.compare_losses(str(first), str(second), str(out), rtol=1e-6) == 1
    empty = tmp_path / "empty.log"
    empty.write_text("no losses here\n")
    assert helper.compare_losses(str(first), str(empty), str(out), rtol=1e-3) == 1


@pytest.mark.smoke  # it launches pretrain_gpt.py with torchrun (about 40 s on two cores)
def test_cpu_dry_mode_runs_every_step(tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu", PYTHON=sys.executable, OUT=str(tmp_path),
               PYTHONPATH=str(ROOT))
    completed = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                               timeout=300)  # two more short runs: step e
    summary = (tmp_path / "summary.txt").read_text()
    assert completed.returncode == 0, summary + completed.stdout[-3000:]
    for step in ("stage", "p2p", "smoke-first-cpu", "smoke-cpu", "smoke-compare",
                 "deterministic-1", "deterministic-2", "deterministic-compare", "measure",
                 "plan-with-profile", "depth"):
        assert f"[ok]     {step}" in summary, summary
    assert "loss comparison over 3 iterations" in summary
    stage = json.loads((tmp_path / "stage.json").read_text())
    assert [row["micro_batch_size"] for row in stage["rows"]] == [1, 2]
    assert json.loads((tmp_path / "profile.json").read_text())["hardware"]["flops_per_second"] > 0
