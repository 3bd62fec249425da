"""A launcher that sets RANK and WORLD_SIZE but not MASTER_ADDR (a site's own wrapper, a shell
loop) trains on 127.0.0.1, as read_launch_environment says, instead of a KeyError traceback."""

import os

from torchrun_helpers import REPO, free_port, run_ranks_directly

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 "
        "--train-iters 1 --log-interval 1 --mock-data --vocab-size 128 "
        "--pipeline-model-parallel-size 2 --distributed-timeout-minutes 1").split()


def test_ranks_started_with_rank_and_world_size_only_train():
    port = free_port()
    environments = []
    for rank in range(2):
        env = {name: value for name, value in os.environ.items()
               if not name.startswith(("MASTER_", "SLURM_", "TORCHELASTIC_", "LOCAL_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=REPO)
        environments.append(env)
    outputs = run_ranks_directly(environments, ARGV)
    assert "KeyError" not in "".join(outputs)
    assert "iteration        1/       1 |" in outputs[1]  # the last pipeline rank logs
