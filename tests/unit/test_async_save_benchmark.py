"""benchmarks/async_save.py without processes: its configurations, and that it reads the iteration
time from the training log line as ``format_iteration_line`` writes it."""

from __future__ import annotations

import os
import sys

from megatron.training.logging_utils import format_iteration_line

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import async_save  # noqa: E402


def _line(iteration: int, elapsed_ms: float) -> str:
    return format_iteration_line(
        iteration=iteration, train_iters=12, consumed_samples=16 * iteration,
        elapsed_ms=elapsed_ms, throughput_tflops=0.01, learning_rate=1e-3, global_batch_size=16,
        losses={"lm loss": 8.5}, loss_scale=1.0, grad_norm=1.5, skipped_iterations=0,
        nan_iterations=0)


def test_configurations_save_every_iteration_in_the_background():
    configs = async_save.configurations("/tmp/ck", with_sync=False)
    assert configs == {"no-save": [], "async-save": ["--save", "/tmp/ck", "--save-interval", "1",
                                                     "--async-save"]}
    assert "--async-save" not in async_save.configurations("/tmp/ck", True)["sync-save"]
    worker = async_save.configurations("/tmp/ck", False, with_worker=True)["async-save-worker"]
    assert worker == configs["async-save"] + ["--use-persistent-ckpt-worker"]


def test_iteration_times_are_read_from_the_log_line():
    log = "\n".join([_line(1, 900.0), "saving checkpoint at iteration 1", _line(2, 123.4)])
    assert async_save.ITERATION.findall(log) == [("1", "900.0"), ("2", "123.4")]


def test_demo_model_flags_match_the_readme_demo():
    demo = open(os.path.join(async_save.REPO_ROOT, "examples", "demo_chimera.sh")).read()
    for flag in ("--pipeline-model-parallel-size 4 --pipeline-schedule chimera",
                 "--num-layers 8 --hidden-size 64 --num-attention-heads 4",
                 "--micro-batch-size 2 --global-batch-size 16"):
        assert flag in demo and flag in " ".join(async_save.DEMO_FLAGS), flag
