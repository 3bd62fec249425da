"""Smoke (tier 3): ``torchrun pretrain_gpt.py`` with TP=2 and with DP=2 prints the same five lm loss
values as one process (issue 2's "Done when" command; ``--eval-iters 1`` only shortens the final
evaluation, it does not touch training)."""

import pytest

from torchrun_helpers import finish, launch, logged_losses

pytestmark = pytest.mark.smoke

COMMAND = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
           "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
           "--train-iters 5 --log-interval 1 --mock-data --seed 1234 --eval-iters 1 "
           "--layout-invariant-attention-dropout").split()  # TP=2 reproduces TP=1 exactly


def _losses(process) -> list[float]:
    output = finish(process, timeout=240)
    assert "validation loss at iteration 5 on validation set | lm loss value: " in output
    return logged_losses(output, 5)


def test_tp2_and_dp2_print_the_single_process_losses():
    # The three runs start together: most of each run's time is start-up, which overlaps.
    runs = {"single": launch(1, COMMAND),
            "tp2": launch(2, COMMAND + ["--tensor-model-parallel-size", "2"]),
            "dp2": launch(2, COMMAND)}
    losses = {name: _losses(process) for name, process in runs.items()}
    for name in ("tp2", "dp2"):
        assert losses[name] == pytest.approx(losses["single"], rel=1e-4), losses
