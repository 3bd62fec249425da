"""Smoke (tier 3): two ``pretrain_gpt.py`` processes started the way ``srun`` starts them (SLURM
variables only, no torchrun) find each other and train with data parallelism."""

import os
import re
import subprocess
import sys

import pytest

from torchrun_helpers import REPO, free_port

pytestmark = pytest.mark.smoke

ARGS = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --vocab-size 64 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-iters 2 --log-interval 1 "
        "--mock-data --eval-iters 0 --distributed-timeout-minutes 1").split()


def test_srun_style_environment_trains_with_two_ranks():
    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    processes = []
    for rank in range(2):
        env = dict(base, SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_STEP_ID="0",  # an srun task step (the batch script has none)
                   SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=REPO)
        processes.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *ARGS], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail("SLURM-style launch did not finish within 120 s")
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    # only the last rank prints the log lines, and it reports a world of 2 data-parallel ranks
    assert "world size: 2 (TP 1, DP 2, PP 1)" in outputs[1]
    assert len(re.findall(r" iteration +\d+/ +2 \|", outputs[1])) == 2
    assert not re.findall(r" iteration +\d+/", outputs[0])
