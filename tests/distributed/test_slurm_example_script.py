"""examples/pretrain_gpt_chimera_slurm.sh as a batch script: its #SBATCH resources, output files and
preemption signal, and the SIGTERM forwarding to srun (run with a fake srun on PATH)."""

import os
import pathlib
import signal
import subprocess
import time

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt_chimera_slurm.sh"

FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" > "$FAKE_SRUN_LOG"
trap 'echo "TERM received" >> "$FAKE_SRUN_LOG"; exit 0' TERM
if [ -n "${FAKE_SRUN_EXIT:-}" ]; then exit "$FAKE_SRUN_EXIT"; fi
while true; do sleep 0.05; done
"""


def sbatch_options() -> dict:
    options = {}
    for line in SCRIPT.read_text().splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line[len("#SBATCH --"):].partition("=")
            options[name] = value
    return options


def test_batch_directives():
    options = sbatch_options()
    assert options["nodes"] == "4" and options["ntasks-per-node"] == "8"
    assert options["gpus-per-node"] == "8"
    assert options["output"].endswith(".out") and options["error"].endswith(".err")
    assert options["signal"] == "B:TERM@120"
    assert "--exit-signal-handler" in SCRIPT.read_text()


def start_script(tmp_path, **env):
    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    log = tmp_path / "srun.log"
    environment = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                   "FAKE_SRUN_LOG": str(log), **env}
    process = subprocess.Popen(["bash", str(SCRIPT)], env=environment, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, log


def test_sigterm_to_the_batch_shell_reaches_srun_and_the_job_ends_cleanly(tmp_path):
    process, log = start_script(tmp_path)
    try:
        deadline = time.monotonic() + 20
        while not log.exists():
            assert time.monotonic() < deadline and process.poll() is None, process.stdout.read()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 does
        output = process.communicate(timeout=20)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "forwarding it to srun" in output
    lines = log.read_text().splitlines()
    assert lines[0].startswith("srun --kill-on-bad-exit=1 python pretrain_gpt.py ")
    assert "--exit-signal-handler" in lines[0] and lines[1:] == ["TERM received"]


@pytest.mark.parametrize("code", ["0", "3"])
def test_script_exits_with_sruns_status(tmp_path, code):
    process, _ = start_script(tmp_path, FAKE_SRUN_EXIT=code)
    output = process.communicate(timeout=20)[0]
    assert process.returncode == int(code), output
