"""TensorBoard and Weights & Biases for real (both packages are in the test extra): one run with
--tensorboard-dir and --wandb-project in wandb's offline mode (no network) writes the same training
scalars to both, and closes both writers at the end."""

import glob
import json
import os
import re

import pytest

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 --lr 1e-3 "
        "--micro-batch-size 2 --global-batch-size 4 --log-interval 1 --eval-iters 0 "
        "--train-iters 3")


def test_tensorboard_and_offline_wandb_receive_the_same_scalars(tmp_path, monkeypatch):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")  # in the [test] extra
    wandb = pytest.importorskip("wandb")  # in the [test] extra
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = parse_args((TINY + f" --tensorboard-dir {tmp_path}/tb --wandb-project chimera-test "
                                f"--wandb-exp-name tiny --wandb-save-dir {tmp_path}/wb").split(),
                        world_size=1)
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lambda line: None)
    losses = [record.losses["lm loss"] for record in result.history]

    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tensorboard_losses = [event.value for event in events.Scalars("lm loss")]
    assert [event.step for event in events.Scalars("lm loss")] == [1, 2, 3]
    assert tensorboard_losses == pytest.approx(losses, rel=1e-6)
    assert {"learning-rate", "batch-size", "loss-scale", "grad-norm"} <= set(events.Tags()["scalars"])

    wandb.teardown()  # the run's records are written by wandb's service; wait for it to stop
    runs = glob.glob(os.path.join(tmp_path, "wb", "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, os.listdir(tmp_path / "wb")
    # every history item appears twice in the file (the step's record and the summary update)
    assert _wandb_history(runs[0], "lm loss")[::2] == pytest.approx(losses, rel=1e-6)
    assert _wandb_history(runs[0], "batch-size") == [4] * 6


def _wandb_history(path: str, key: str) -> list:
    """The values logged under ``key``, read from an offline run's record file: each history item
    is a protobuf message with the key (field 2) and the value as JSON text (field 16)."""
    with open(path, "rb") as handle:
        data = handle.read()
    encoded = key.encode()
    pattern = re.compile(b"\x12" + bytes([len(encoded)]) + re.escape(encoded) + b"\x82\x01")
    values = []
    for match in pattern.finditer(data):
        length = data[match.end()]
        values.append(json.loads(data[match.end() + 1:match.end() + 1 + length]))
    return values
