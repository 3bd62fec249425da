"""Smoke (tier 3): the three Megatron-LM launch scripts of tests/megatron_scripts.py start and
train under torchrun with every flag kept except what must shrink to fit two CPU ranks: model
sizes, TP x PP (2 pipeline ranks), batch and run lengths (the ramp-up kept, scaled down), mock data
instead of their corpora, gloo instead of nccl, and paths under the test's directory. Every other
flag (fp16, activation checkpointing, the LR schedule flags, --data-impl, --attention-backend, ...)
is passed as the script has it."""

import pytest

from megatron_scripts import SCRIPTS, overridden, script_argv
from torchrun_helpers import finish, launch

pytestmark = pytest.mark.smoke

TINY_MODEL = {"--num-layers": "4", "--hidden-size": "32", "--num-attention-heads": "4",
              "--seq-length": "16", "--max-position-embeddings": "16",
              "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "2",
              "--micro-batch-size": "1", "--global-batch-size": "4", "--log-interval": "1",
              "--eval-interval": "2", "--eval-iters": "1", "--save-interval": "2",
              "--mock-data": "", "--vocab-size": "64", "--distributed-timeout-minutes": "2"}
LENGTHS = {
    "pretrain_gpt_distributed_with_mp": {"--train-iters": "3", "--lr-decay-iters": "3",
                                         "--distributed-backend": "gloo"},
    "pretrain_gpt3_175B": {"--rampup-batch-size": "2 2 4", "--train-samples": "14",
                           "--lr-decay-samples": "12", "--lr-warmup-samples": "2"},
    "train_gpt3_175b_distributed": {"--rampup-batch-size": "2 2 4", "--train-iters": "4",
                                    "--lr-decay-iters": "4"},
}
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file")


@pytest.mark.parametrize("name", SCRIPTS)
def test_megatron_script_starts_and_trains(name, tmp_path):
    paths = {"--save": str(tmp_path / "ckpt"), "--load": str(tmp_path / "ckpt")}
    if "--tensorboard-dir" in SCRIPTS[name]:
        paths["--tensorboard-dir"] = str(tmp_path / "tb")
    argv = overridden(script_argv(SCRIPTS[name]), {**TINY_MODEL, **LENGTHS[name], **paths},
                      drop=DATA_FLAGS)
    output = finish(launch(2, argv), 240)
    assert "> pipeline schedule: 1f1b" in output
    assert "successfully saved checkpoint at iteration       2" in output
    assert "validation loss at iteration 2" in output
    if "--rampup-batch-size" in argv:
        assert "global batch size:     2 |" in output and "global batch size:     4 |" in output
