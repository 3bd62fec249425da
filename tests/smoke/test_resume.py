"""Smoke (tier 3): ``torchrun`` of pretrain_gpt.py's main with the checkpointing hook, TP=2. Training
6 iterations straight equals training 3, exiting, and resuming from the checkpoint in a new torchrun:
same printed losses and bitwise-equal final checkpoints (weights and optimizer state)."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from megatron.training.checkpointing import checkpoint_file, read_tracker

pytestmark = pytest.mark.smoke

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = ("--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 "
           "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
           "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-warmup-iters 1 "
           "--train-iters 6 --log-interval 1 --mock-data --seed 1234 --eval-iters 1 "
           "--eval-interval 2 --distributed-timeout-minutes 1").split()
LOSS = re.compile(r" iteration +(\d+)/ +6 \|.*\| lm loss: ([0-9.E+-]+) \|")

# pretrain_gpt.main with the checkpointing hook passed to pretrain (what pretrain_gpt.py runs once
# the hook is wired in there).
ENTRY = """
import functools, sys
import pretrain_gpt
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer
from megatron.training.training import pretrain

config = parse_args(sys.argv[1:])
tokenizer = pretrain_gpt.build_run_tokenizer(config)
log = lambda line: print(line, flush=True)
pretrain(config, pretrain_gpt.model_provider,
         functools.partial(pretrain_gpt.datasets_provider, tokenizer=tokenizer),
         pretrain_gpt.forward_step, checkpointing=Checkpointer(config, log=log), log=log)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(entry: str, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               entry, *COMMAND, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _output(process: subprocess.Popen) -> str:
    try:
        output, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"the run did not finish within 120 s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


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
    entry = tmp_path / "pretrain_gpt_with_checkpointing.py"
    entry.write_text(ENTRY)
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    # the straight run and the first part start together: most of each is start-up
    straight = _launch(str(entry), ["--save", straight_dir])
    first = _launch(str(entry), ["--save", resumed_dir, "--exit-interval", "3"])
    straight_output, first_output = _output(straight), _output(first)
    assert "exiting program at iteration 3" in first_output
    assert read_tracker(resumed_dir) == 3
    second_output = _output(_launch(str(entry), ["--load", resumed_dir, "--save", resumed_dir]))
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
