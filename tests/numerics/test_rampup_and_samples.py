"""Batch-size ramp-up and samples-based training (Megatron's --rampup-batch-size, --train-samples,
--lr-decay-samples, --lr-warmup-samples): the ramp formula, the iteration count, and the loop."""

from types import SimpleNamespace

import pytest

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.microbatches import global_batch_size_at, iterations_for_samples
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --eval-iters 0 --lr 1e-3")


def test_ramp_follows_megatron_formula_for_the_175b_script():
    """--global-batch-size 1536 --rampup-batch-size 16 16 5859375: 95 increments of 16, one every
    5859375 / 95 = 61677.6 samples."""
    training = SimpleNamespace(global_batch_size=1536, rampup_batch_size=[16, 16, 5859375])
    assert global_batch_size_at(training, 0) == 16
    assert global_batch_size_at(training, 61677) == 16
    assert global_batch_size_at(training, 61678) == 32
    assert global_batch_size_at(training, 5859375) == 16 + 95 * 16 == 1536
    assert global_batch_size_at(training, 10 ** 9) == 1536
    assert global_batch_size_at(SimpleNamespace(global_batch_size=64, rampup_batch_size=None),
                                0) == 64


def test_iterations_for_samples_counts_the_ramp_iteration_by_iteration():
    training = SimpleNamespace(global_batch_size=8, rampup_batch_size=[2, 2, 12])
    # ramp: batches 2, 2, 4, 6 (14 samples), then (46 - 14) // 8 = 4 full batches
    assert iterations_for_samples(training, 46) == 8
    assert iterations_for_samples(SimpleNamespace(global_batch_size=8, rampup_batch_size=None),
                                  46) == 5


def test_samples_based_flags_derive_the_schedule():
    config = parse_args((TINY + " --train-samples 80 --lr-warmup-samples 16").split(),
                        world_size=1)
    assert config.training.train_iters == 10
    assert config.optimizer.lr_decay_samples == 80  # defaults to --train-samples
    assert config.optimizer.lr_decay_iters is None


def test_loop_grows_the_batch_and_steps_the_schedule_by_samples():
    config = parse_args((TINY + " --rampup-batch-size 2 2 12 --train-samples 46 "
                         "--lr-warmup-samples 8 --lr-decay-style linear --min-lr 1e-4").split(),
                        world_size=1)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lines.append)
    assert result.state.iteration == 8 and result.state.consumed_train_samples == 46
    batch_sizes = [int(line.split("global batch size:")[1].split("|")[0])
                   for line in lines if "global batch size:" in line]
    assert batch_sizes == [2, 2, 4, 6, 8, 8, 8, 8]
    # the lr of each iteration is the schedule at the samples consumed before it
    consumed = [0, 2, 4, 8, 14, 22, 30, 38]
    expected = [1e-3 * c / 8 if c <= 8 else 1e-4 + 9e-4 * (1 - (c - 8) / (46 - 8))
                for c in consumed]
    assert [record.learning_rate for record in result.history] == pytest.approx(expected,
                                                                                abs=1e-12)
