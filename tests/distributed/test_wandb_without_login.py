"""--wandb-project on a machine where W&B has no API key (no `wandb login`, online mode): one line
with the fix and exit 2 before any process group, instead of wandb's UsageError on the logging
rank after the model is built (its peers then died on a closed gloo connection). Offline mode
needs no key and trains."""

import os
import subprocess
import sys

from torchrun_helpers import REPO

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 --lr 1e-3 "
        "--train-iters 1 --log-interval 1 --mock-data --vocab-size 128 "
        "--wandb-project journey").split()


def _run(home, **extra_env):
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("WANDB_", "RANK", "WORLD_SIZE", "SLURM_", "MASTER_"))}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home), WANDB_DIR=str(home),
               WANDB_SILENT="true", OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra_env)
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *ARGV,
                           "--wandb-save-dir", str(home)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_online_wandb_without_an_api_key_stops_at_once_with_the_fix(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith("pretrain_gpt.py: error: --wandb-project: W&B is in online mode "
                                  "but finds no API key"), done.stderr
    assert "WANDB_MODE=offline" in done.stderr and "wandb login" in done.stderr
    assert "Traceback" not in done.stderr


def test_offline_wandb_needs_no_api_key(tmp_path):
    done = _run(tmp_path, WANDB_MODE="offline")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "iteration        1/       1 |" in done.stdout
