"""Smoke (tier 3): --rampup-batch-size with pipeline parallelism. Chimera on PP 2 x DP 2 and 1F1B
on PP 2 grow the batch like one process (4, 4, 8, 12, then 16) and print its lm losses
(relative 1e-4): the runtime plans the schedule once per micro-batch count of the ramp."""

import re

import pytest

from torchrun_helpers import finish, launch

pytestmark = pytest.mark.smoke

ITERATIONS = 6
COMMAND = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--max-position-embeddings 16 --vocab-size 64 --micro-batch-size 2 "
           "--global-batch-size 16 --rampup-batch-size 4 4 24 --train-samples 72 --lr 1e-3 "
           "--log-interval 1 --mock-data --seed 1234 --eval-iters 0 "
           "--layout-invariant-attention-dropout").split()
LINE = re.compile(r" iteration +(\d+)/ +\d+ \|.*\| global batch size: +(\d+) \| lm loss: ([0-9.E+-]+) \|")


def _batches_and_losses(output: str) -> tuple[list[int], list[float]]:
    found = LINE.findall(output)
    assert [int(i) for i, _, _ in found] == list(range(1, ITERATIONS + 1)), output[-3000:]
    return [int(b) for _, b, _ in found], [float(loss) for _, _, loss in found]


def test_rampup_under_chimera_and_1f1b_prints_the_single_process_losses():
    single = launch(1, COMMAND)
    chimera = launch(4, COMMAND + ["--pipeline-model-parallel-size", "2",
                                   "--pipeline-schedule", "chimera"])
    batches, expected = _batches_and_losses(finish(single))
    assert batches == [4, 4, 8, 12, 16, 16]  # Megatron's ramp: +4 every 8 samples
    chimera_batches, chimera_losses = _batches_and_losses(finish(chimera))
    assert chimera_batches == batches
    assert chimera_losses == pytest.approx(expected, rel=1e-4)
    one_f_one_b = launch(2, COMMAND + ["--pipeline-model-parallel-size", "2"])
    assert _batches_and_losses(finish(one_f_one_b)) == (batches, pytest.approx(expected, rel=1e-4))
