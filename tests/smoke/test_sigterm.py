"""Smoke (tier 3): SIGTERM under torchrun (SLURM preemption, scancel, ``#SBATCH --signal``).

* ``--exit-signal-handler`` and SIGTERM to every worker (what srun does with one task per rank):
  every rank saves at the end of the current iteration and the run exits 0; resuming from that
  checkpoint prints the losses of an uninterrupted run.
* The same with SIGTERM to the torchrun agent: torchrun forwards it to its workers, which save
  the same way; torchrun itself then exits non-zero (its own SignalException), the checkpoint is
  complete.
* Without the handler: SIGTERM unwinds through the teardown with status 143; the checkpoints
  already saved stay readable.
"""

import os
import re
import signal
import subprocess

import pytest

from megatron.training.checkpointing import checkpoint_file, read_tracker
from torchrun_helpers import finish, launch

pytestmark = pytest.mark.smoke

TRAIN_ITERS = 60
COMMAND = ("--pipeline-model-parallel-size 2 --pipeline-schedule chimera --num-layers 4 "
           "--hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
           "--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --log-interval 1 --eval-iters 0 "
           f"--train-iters {TRAIN_ITERS} --distributed-timeout-minutes 1 --ckpt-format torch").split()
LOSS = re.compile(rf" iteration +(\d+)/ +{TRAIN_ITERS} \|.*\| lm loss: ([0-9.E+-]+) \|")


def _losses(output: str) -> dict:
    return {int(i): value for i, value in LOSS.findall(output)}  # printed strings, compared exactly


def _signal_after_iteration(process: subprocess.Popen, iteration: int, to_agent: bool,
                            timeout: float = 150) -> str:
    """Read the run's output; once ``iteration`` is logged send SIGTERM to the torchrun agent or
    to each of its workers; return the whole output after the run ended."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if f" iteration {iteration:8d}/" in line:
            if to_agent:
                os.kill(process.pid, signal.SIGTERM)
            else:
                workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                         text=True, check=True).stdout.split()
                assert len(workers) == 2, workers
                for pid in workers:
                    os.kill(int(pid), signal.SIGTERM)
    process.wait(timeout=timeout)
    return "".join(lines)


def _assert_complete_checkpoint(directory: str) -> int:
    iteration = read_tracker(directory)
    assert iteration is not None and 3 <= iteration < TRAIN_ITERS, iteration
    for pp_rank in range(2):
        assert os.path.getsize(checkpoint_file(directory, iteration, 0, pp_rank, 2)) > 0
    return iteration


def test_sigterm_to_every_worker_saves_exits_zero_and_resumes_exactly(tmp_path):
    saved = str(tmp_path / "signalled")
    straight = launch(2, COMMAND)
    signalled = launch(2, COMMAND + ["--save", saved, "--exit-signal-handler"])
    output = _signal_after_iteration(signalled, 3, to_agent=False)
    assert signalled.returncode == 0, output[-3000:]
    iteration = _assert_complete_checkpoint(saved)
    assert f"exiting program at iteration {iteration}" in output
    resumed = finish(launch(2, COMMAND + ["--load", saved, "--save", saved]), 150)
    straight_losses = _losses(finish(straight, 150))
    assert sorted(straight_losses) == list(range(1, TRAIN_ITERS + 1))
    assert {**_losses(output), **_losses(resumed)} == straight_losses
    assert sorted(_losses(resumed)) == list(range(iteration + 1, TRAIN_ITERS + 1))


def test_sigterm_to_the_torchrun_agent_still_saves_on_every_rank(tmp_path):
    saved = str(tmp_path / "agent")
    process = launch(2, COMMAND + ["--save", saved, "--exit-signal-handler"])
    output = _signal_after_iteration(process, 3, to_agent=True)
    iteration = _assert_complete_checkpoint(saved)
    assert f"exiting program at iteration {iteration}" in output
    assert process.returncode != 0  # torchrun's own status after a signal


def test_sigterm_without_the_handler_exits_143_and_keeps_saved_checkpoints(tmp_path):
    saved = str(tmp_path / "plain")
    process = launch(2, COMMAND + ["--save", saved, "--save-interval", "2"])
    output = _signal_after_iteration(process, 5, to_agent=False)
    assert process.returncode != 0, output[-3000:]
    assert "exitcode  : 143" in output or "exitcode: 143" in output, output[-3000:]
    _assert_complete_checkpoint(saved)
