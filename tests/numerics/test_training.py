"""Training loop in one process: learning on mock data, fp16 overflow skipping, LR in the loop,
log-line format, FLOPs formula, micro-batch order and the mock dataset's determinism."""

import datetime
import math

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.core.datasets.mock_dataset import MockGPTDataset, build_mock_datasets
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.flops import gpt_flops_per_iteration, throughput_tflops_per_gpu
from megatron.training.logging_utils import (IntervalStats, format_iteration_line,
                                             format_validation_lines)
from megatron.training.microbatches import batch_from_samples, microbatch_sample_ids
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --eval-iters 0")


def _run(extra: str, world_size: int = 1):
    config = parse_args((TINY + " " + extra).split(), world_size=world_size)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lines.append)
    return result, lines


def _last_iteration_line(lines: list[str]) -> str:
    return [line for line in lines if " iteration " in line and "consumed samples" in line][-1]


def test_a_few_iterations_on_mock_data_lower_the_loss():
    result, lines = _run("--lr 3e-3 --train-iters 12 --lr-decay-style constant "
                         "--hidden-dropout 0 --attention-dropout 0")
    losses = [record.losses["lm loss"] for record in result.history]
    # starts near uniform guessing over the padded vocabulary (64 padded to 128)
    assert losses[0] == pytest.approx(math.log(128), rel=0.05)
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses
    assert sum("| lm loss:" in line for line in lines) == 12
    assert result.state.iteration == 12 and result.state.consumed_train_samples == 96


def test_fp16_overflow_skips_steps_and_counts_them():
    # The default initial scale 2**32 overflows fp16 activations' gradients: Megatron skips those
    # steps, halves the scale once the hysteresis (2) is used up, and does not advance the LR.
    result, lines = _run("--lr 1e-3 --train-iters 4 --fp16 --lr-warmup-iters 2")
    skipped = [record.skipped for record in result.history]
    scales = [record.loss_scale for record in result.history]
    assert skipped == [True, True, True, True]
    assert scales == [2.0**32, 2.0**31, 2.0**30, 2.0**29]
    assert all(record.grad_norm is None for record in result.history)
    assert all(record.learning_rate == 0.0 for record in result.history)  # warm-up never advanced
    last = _last_iteration_line(lines)  # the timer block follows it
    assert "number of skipped iterations:   1 |" in last
    assert "grad norm" not in last and "lm loss" not in last


def test_fp16_static_scale_trains_without_skips_and_matches_fp32_loosely():
    fp16, _ = _run("--lr 1e-3 --train-iters 2 --fp16 --loss-scale 1024")
    fp32, _ = _run("--lr 1e-3 --train-iters 2")
    assert not any(record.skipped for record in fp16.history)
    assert fp16.history[0].loss_scale == 1024.0
    for a, b in zip(fp16.history, fp32.history):
        assert a.losses["lm loss"] == pytest.approx(b.losses["lm loss"], rel=1e-2)


def test_bf16_runs_close_to_fp32():
    bf16, lines = _run("--lr 1e-3 --train-iters 2 --bf16")
    fp32, _ = _run("--lr 1e-3 --train-iters 2")
    assert "loss scale: 1.0 |" in _last_iteration_line(lines)
    for a, b in zip(bf16.history, fp32.history):
        assert a.losses["lm loss"] == pytest.approx(b.losses["lm loss"], rel=2e-2)


def test_learning_rate_follows_the_schedule_in_the_loop():
    result, lines = _run("--lr 1e-3 --min-lr 1e-4 --train-iters 6 --lr-warmup-iters 2 "
                         "--lr-decay-style linear")
    used = [record.learning_rate for record in result.history]
    # Megatron: iteration k uses the lr at (k - 1) * global batch samples.
    expected = [0.0, 5e-4, 1e-3, 1e-4 + 0.75 * 9e-4, 1e-4 + 0.5 * 9e-4, 1e-4 + 0.25 * 9e-4]
    assert used == pytest.approx(expected, abs=1e-12)
    line_4 = next(line for line in lines if "iteration        4/" in line)
    assert "learning rate: 5.500000E-04 |" in line_4  # the lr the next iteration will use


def test_exit_interval_stops_early_and_validation_lines_appear():
    config = parse_args((TINY.replace("--eval-iters 0", "--eval-iters 2") +
                         " --lr 1e-3 --train-iters 6 --eval-interval 2 --exit-interval 3").split(),
                        world_size=1)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lines.append)
    assert result.exited_early and result.state.iteration == 3
    assert [prefix for prefix, _ in result.validation] == ["iteration 2"]
    assert result.state.consumed_valid_samples == 16
    assert any(line.startswith(" validation loss at iteration 2 | lm loss value: ")
               for line in lines)
    assert lines[-1] == "exiting program at iteration 3"


def test_iteration_log_line_format_is_megatron_s():
    line = format_iteration_line(
        iteration=10, train_iters=100, consumed_samples=640, elapsed_ms=412.34,
        throughput_tflops=1.23, learning_rate=3e-4, global_batch_size=64,
        losses={"lm loss": 7.123456}, loss_scale=1.0, grad_norm=1.2344, skipped_iterations=0,
        nan_iterations=0, now=datetime.datetime(2026, 11, 30, 12, 0, 0))
    assert line == (
        " [2026-11-30 12:00:00] iteration       10/     100 | consumed samples:          640 | "
        "elapsed time per iteration (ms): 412.3 | throughput per GPU (TFLOP/s/GPU): 1.2 | "
        "learning rate: 3.000000E-04 | global batch size:    64 | lm loss: 7.123456E+00 | "
        "loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |")


def test_validation_lines_format():
    dashes, line, closing = format_validation_lines("iteration 10", {"lm loss": 2.0})
    assert line == " validation loss at iteration 10 | lm loss value: 2.000000E+00 | " \
                   "lm loss PPL: 7.389056E+00 | "
    assert dashes == closing == "-" * (len(line) + 1)
    assert "PPL: 4.851652E+08" in format_validation_lines("x", {"lm loss": 50.0})[1]


def test_interval_stats_average_only_advanced_iterations():
    stats = IntervalStats()
    stats.add({"lm loss": 2.0}, skipped=False, got_nan=False)
    stats.add({"lm loss": 100.0}, skipped=True, got_nan=False)
    stats.add({"lm loss": 4.0}, skipped=False, got_nan=True)
    assert stats.average_losses() == {"lm loss": 3.0}
    assert (stats.iterations, stats.skipped_iterations, stats.nan_iterations) == (3, 1, 1)


def test_flops_formula_matches_the_convention():
    config = parse_args("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
                        "--seq-length 1024 --max-position-embeddings 1024 --mock-data "
                        "--vocab-size 50257 --lr 1e-4 --train-iters 1 --global-batch-size 64"
                        .split(), world_size=1)
    B, s, L, h, V = 64, 1024, 24, 1024, config.model.padded_vocab_size
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert gpt_flops_per_iteration(config.model, B) == pytest.approx(expected, rel=1e-12)
    assert throughput_tflops_per_gpu(expected, 2.0, 8) == pytest.approx(expected / 16e12)


def test_microbatch_order_is_megatron_s():
    # global batch of 8 from sample 40, mbs 2, DP 2 -> 2 micro-batches per rank
    assert microbatch_sample_ids(40, 2, 2, 0, 2) == [range(40, 42), range(44, 46)]
    assert microbatch_sample_ids(40, 2, 2, 1, 2) == [range(42, 44), range(46, 48)]
    union = sorted(i for rank in range(2) for ids in microbatch_sample_ids(40, 2, 2, rank, 2)
                   for i in ids)
    assert union == list(range(40, 48))


def test_batch_from_samples_shifts_labels_and_keeps_sample_ids():
    samples = [{"text": np.arange(5) + 10 * i} for i in range(2)]
    batch = batch_from_samples(samples, range(7, 9), torch.device("cpu"))
    assert batch["tokens"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert batch["labels"].tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert batch["loss_mask"].shape == (2, 4) and batch["sample_ids"].tolist() == [7, 8]


def test_mock_dataset_is_deterministic_learnable_and_split_specific():
    dataset = MockGPTDataset(100, 16, 64, seed=3)
    again = MockGPTDataset(100, 16, 64, seed=3)
    for i in (0, 57, 99):
        assert np.array_equal(dataset[i]["text"], again[i]["text"])
        text = dataset[i]["text"]
        assert text.dtype == np.int64 and text.shape == (17,)
        assert ((text.min() >= 0) and (text.max() < 64))
        steps = np.diff(text) % 64
        assert len(set(steps.tolist())) == 1 and 1 <= steps[0] <= 8  # an arithmetic progression
    other_seed = MockGPTDataset(100, 16, 64, seed=4)
    assert any(not np.array_equal(dataset[i]["text"], other_seed[i]["text"]) for i in range(10))
    train, valid, test = build_mock_datasets((10, 5, 0), 16, 64, seed=3)
    assert test is None and len(valid) == 5
    assert any(not np.array_equal(train[i]["text"], valid[i]["text"]) for i in range(5))
    with pytest.raises(IndexError):
        dataset[100]


class _ListWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step, value))


def test_tensorboard_scalars_use_megatron_tags():
    config = parse_args((TINY.replace("--eval-iters 0", "--eval-iters 1") +
                         " --lr 1e-3 --train-iters 2 --eval-interval 2").split(), world_size=1)
    writer = _ListWriter()
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lambda _: None, tensorboard_writer=writer)
    tags = {(tag, step) for tag, step, _ in writer.scalars}
    for step in (1, 2):
        assert {("lm loss", step), ("learning-rate", step), ("loss-scale", step),
                ("grad-norm", step), ("batch-size", step)} <= tags
    assert ("lm loss validation", 2) in tags and ("lm loss validation ppl", 2) in tags
    loss_1 = next(v for tag, step, v in writer.scalars if tag == "lm loss" and step == 1)
    assert loss_1 == result.history[0].losses["lm loss"]


def test_tensorboard_dir_needs_the_package_or_writes_events(tmp_path):
    from megatron.training.logging_utils import build_tensorboard_writer
    config = parse_args((TINY + f" --lr 1e-3 --train-iters 1 --tensorboard-dir {tmp_path}")
                        .split(), world_size=1)
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install tensorboard"):
            build_tensorboard_writer(config.logging, True)
    else:
        writer = build_tensorboard_writer(config.logging, True)
        writer.add_scalar("x", 1.0, 1)
        writer.close()
        assert any(tmp_path.iterdir())
    assert build_tensorboard_writer(parse_args((TINY + " --lr 1e-3 --train-iters 1").split(),
                                               world_size=1).logging, True) is None
