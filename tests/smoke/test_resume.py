"""Smoke (tier 3): ``torchrun pretrain_gpt.py`` with TP=2 and checkpointing. Training 6 iterations
straight equals training 3, exiting, and resuming from the checkpoint in a new torchrun: same printed
losses and bitwise-equal final checkpoints (weights and optimizer state)."""

import re

import pytest
import torch

from megatron.training.checkpointing import checkpoint_file, read_tracker
from torchrun_helpers import finish, launch

pytestmark = pytest.mark.smoke

COMMAND = ("--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 "
           "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
           "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 "
           "--train-iters 6 --log-interval 1 --mock-data --seed 1234 --eval-iters 1 "
           "--eval-interval 2 --distributed-timeout-minutes 1 --ckpt-format torch").split()
LOSS = re.compile(r" iteration +(\d+)/ +6 \|.*\| lm loss: ([0-9.E+-]+) \|")


def _losses(output: str) -> dict:
    return {int(i): value for i, value in LOSS.findall(output)}  # printed strings, compared exactly


def _assert_same_state(path_a: str, path_b: str) -> None:
    a, b = (torch.load(path, weights_only=True) for path in (path_a, path_b))
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    state_a, state_b = a["optimizer"]["optimizer"]["state"], b["optimizer"]["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key, value in state_a[index].items():
            assert torch.equal(value, state_b[index][key]), (index, key)
    assert a["opt_param_scheduler"] == b["opt_param_scheduler"]
    assert (a["iteration"], a["consumed_train_samples"], a["consumed_valid_samples"]) == \
        (b["iteration"], b["consumed_train_samples"], b["consumed_valid_samples"])


def test_torchrun_resume_equals_straight_training(tmp_path):
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # the straight run and the first part start together: most of each is start-up
    straight = launch(2, COMMAND + ["--save", straight_dir])
    first = launch(2, COMMAND + ["--save", resumed_dir, "--exit-interval", "3"])
    straight_output, first_output = finish(straight, 120), finish(first, 120)
    assert "exiting program at iteration 3" in first_output
    assert read_tracker(resumed_dir) == 3
    second_output = finish(launch(2, COMMAND + ["--load", resumed_dir, "--save", resumed_dir]),
                           120)
    assert "no checkpoint found" not in second_output
    assert f"loading checkpoint from {resumed_dir} at iteration 3" in second_output

    straight_losses = _losses(straight_output)
    assert sorted(straight_losses) == [1, 2, 3, 4, 5, 6], straight_output[-3000:]
    assert {**_losses(first_output), **_losses(second_output)} == straight_losses
    assert sorted(_losses(second_output)) == [4, 5, 6]
    assert read_tracker(straight_dir) == read_tracker(resumed_dir) == 6
    for tp_rank in range(2):
        _assert_same_state(checkpoint_file(straight_dir, 6, tp_rank, 0, 1),
                           checkpoint_file(resumed_dir, 6, tp_rank, 0, 1))
