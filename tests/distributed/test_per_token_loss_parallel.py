"""--calculate-per-token-loss in parallel layouts: with loss masks that differ between samples, data
parallelism and Chimera pipelines reproduce the single-process per-token loss (a float64 model; the
reported loss is float32, so 1e-6 relative), and so does one micro-batch holding the whole batch."""

from __future__ import annotations

import functools
import pytest

import pretrain_gpt
from data_helpers import uneven_loss_mask_datasets
from dist_harness import run_distributed
from pipeline_reference import test_model_provider as float64_model
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --global-batch-size 8 --lr 1e-2 --train-iters 3 "
        "--log-interval 1 --eval-iters 0 --attention-dropout 0 --hidden-dropout 0 "
        "--calculate-per-token-loss")


# Samples whose loss masks differ: every third sample counts only its first 5 tokens.
uneven_datasets = functools.partial(uneven_loss_mask_datasets, period=3, remainder=0, kept=5)


def _train(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    state = ParallelState.single_process() if world_size == 1 else None
    result = pretrain(config, float64_model, uneven_datasets, pretrain_gpt.forward_step,
                      parallel_state=state, log=lambda _: None)
    return [record.losses["lm loss"] for record in result.history]


@pytest.mark.parametrize("layout", [
    "--micro-batch-size 1", "--micro-batch-size 2 --pipeline-model-parallel-size 2 "
                            "--pipeline-schedule chimera"], ids=["dp2", "chimera-pp2"])
def test_per_token_loss_is_the_same_in_every_layout(layout):
    whole = _train(0, 1, f"{TINY} --micro-batch-size 8")
    for losses in run_distributed(_train, 2, f"{TINY} {layout}", timeout=240):
        assert losses == pytest.approx(whole, rel=1e-6)
    averaged = _train(0, 1, f"{TINY.replace(' --calculate-per-token-loss', '')} "
                            f"--micro-batch-size 1")
    assert averaged != pytest.approx(whole, rel=1e-4)  # the flag matters for these masks
