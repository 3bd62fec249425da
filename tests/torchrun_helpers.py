"""Launch ``pretrain_gpt.py`` under torchrun from a test and read the lm loss of its log lines."""

import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = re.compile(r" iteration +(\d+)/ +(\d+) \|.*\| lm loss: ([0-9.E+-]+) \|")
VALIDATION = re.compile(r"validation loss at (.*?) \| lm loss value: ([0-9.E+-]+) \|")


def free_port() -> int:
    """A TCP port nobody listens on right now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nproc: int, arguments: list[str]) -> subprocess.Popen:
    """Start ``torchrun --nproc-per-node nproc pretrain_gpt.py arguments`` (one thread per rank).

    The rendezvous endpoint's port 0 lets torchrun bind a free port itself (a port picked here
    and bound later can be taken by another launch in between)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
               os.path.join(REPO, "pretrain_gpt.py"), *arguments]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for the run; fail the test with the output's tail if it fails or hangs."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"pretrain_gpt.py did not finish within {timeout:.0f} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


def run_ranks_directly(environments: list[dict], arguments: list[str],
                       timeout: float = 120) -> list[str]:
    """Start ``pretrain_gpt.py`` once per environment (one rank each, no launcher: the way
    ``srun`` or a site's own wrapper starts them) and return every rank's output; a rank that
    fails or a launch that hangs fails the test with the output's tail (every rank is killed)."""
    processes = [subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"),
                                   *arguments], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for env in environments]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail(f"{len(processes)} directly started ranks did not finish within "
                        f"{timeout:.0f} s")
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    return outputs


def logged_losses(output: str, train_iters: int) -> list[float]:
    """The lm loss of every iteration's log line (--log-interval 1)."""
    found = [(int(i), float(v)) for i, total, v in LOSS.findall(output)]
    assert [i for i, _ in found] == list(range(1, train_iters + 1)), output[-3000:]
    return [v for _, v in found]


def validation_losses(output: str) -> dict:
    """``{"iteration 5 on validation set": loss, ...}`` from the validation lines."""
    return {where: float(value) for where, value in VALIDATION.findall(output)}
