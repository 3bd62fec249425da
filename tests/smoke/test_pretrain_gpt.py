"""Smoke (tier 3): ``torchrun pretrain_gpt.py`` with TP=2 and with DP=2 prints the same five lm loss
values as one process (issue 2's "Done when" command; ``--eval-iters 1`` only shortens the final
evaluation, it does not touch training)."""

import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
           "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
           "--train-iters 5 --log-interval 1 --mock-data --seed 1234 --eval-iters 1").split()
LOSS = re.compile(r" iteration +(\d+)/ +5 \|.*\| lm loss: ([0-9.E+-]+) \|")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(nproc: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               os.path.join(REPO, "pretrain_gpt.py"), *COMMAND, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _losses(process: subprocess.Popen) -> list[float]:
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"pretrain_gpt.py did not finish within 240 s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    found = [(int(i), float(v)) for i, v in LOSS.findall(output)]
    assert [i for i, _ in found] == [1, 2, 3, 4, 5], output[-3000:]
    assert "validation loss at iteration 5 on validation set | lm loss value: " in output
    return [v for _, v in found]


def test_tp2_and_dp2_print_the_single_process_losses():
    # The three runs start together: most of each run's time is start-up, which overlaps.
    runs = {"single": _launch(1, []),
            "tp2": _launch(2, ["--tensor-model-parallel-size", "2"]),
            "dp2": _launch(2, [])}
    losses = {name: _losses(process) for name, process in runs.items()}
    for name in ("tp2", "dp2"):
        assert losses[name] == pytest.approx(losses["single"], rel=1e-4), losses
