"""Smoke (tier 3): two ``pretrain_gpt.py`` processes started the way ``srun`` starts them (SLURM
variables only, no torchrun) find each other and train with data parallelism."""

import os
import re

import pytest

from torchrun_helpers import REPO, free_port, run_ranks_directly

pytestmark = pytest.mark.smoke

ARGS = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --vocab-size 64 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-iters 2 --log-interval 1 "
        "--mock-data --eval-iters 0 --distributed-timeout-minutes 1").split()


def test_srun_style_environment_trains_with_two_ranks():
    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    environments = [dict(base, SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                         SLURM_STEP_ID="0",  # an srun task step (the batch script has none)
                         SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port),
                         OMP_NUM_THREADS="1", PYTHONPATH=REPO)
                    for rank in range(2)]
    outputs = run_ranks_directly(environments, ARGS)
    # only the last rank prints the log lines, and it reports a world of 2 data-parallel ranks
    assert "world size: 2 (TP 1, DP 2, PP 1)" in outputs[1]
    assert len(re.findall(r" iteration +\d+/ +2 \|", outputs[1])) == 2
    assert not re.findall(r" iteration +\d+/", outputs[0])
