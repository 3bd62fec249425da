"""Megatron's timer block after each log line (--timing-log-level, --timing-log-option)."""

import re

import torch

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.timers import Timers
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 --lr 1e-3 "
        "--micro-batch-size 2 --global-batch-size 4 --log-interval 2 --eval-iters 0 --train-iters 4")
TIMER_LINE = re.compile(r"^    ([a-z-]+) \.+: \((\d+\.\d\d), (\d+\.\d\d)\)$")


def _run(extra: str) -> list[str]:
    config = parse_args((TINY + " " + extra).split(), world_size=1)
    lines = []
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
             pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
             log=lines.append)
    return lines


def test_timer_block_follows_each_log_line_with_the_level_s_timers():
    lines = _run("--timing-log-level 1")
    headers = [i for i, line in enumerate(lines) if line == "(min, max) time across ranks (ms):"]
    assert len(headers) == 2  # iterations 2 and 4
    for header in headers:
        assert "iteration" in lines[header - 1]
        block = [TIMER_LINE.match(line) for line in lines[header + 1:header + 4]]
        # Megatron's level-1 timers in training_log's order (all-grads-sync before optimizer)
        assert [match.group(1) for match in block] == [
            "forward-backward", "all-grads-sync", "optimizer"]
        assert header + 4 == len(lines) or not TIMER_LINE.match(lines[header + 4])
        forward_backward = float(block[0].group(2))
        assert forward_backward > 0 and block[0].group(2) == block[0].group(3)  # one rank
        assert len(lines[header + 1].split(":")[0]) == 4 + len("forward-backward") + 1 + 32


def test_level_zero_the_default_prints_no_timer_block_as_megatron():
    # Megatron starts forward-backward, optimizer and all-grads-sync at log level 1 and
    # batch-generator at 2, so its default --timing-log-level 0 prints no block.
    lines = _run("")
    assert sum(" iteration " in line and "consumed samples" in line for line in lines) == 2
    assert not any("time across ranks" in line or TIMER_LINE.match(line) for line in lines)


def test_options_max_and_all():
    table = torch.tensor([[10.0, 1.0], [12.5, 3.0]], dtype=torch.float64)
    assert Timers(0, "max", torch.device("cpu"))._format(["forward-backward", "optimizer"], table) \
        == ["max time across ranks (ms):",
            "    forward-backward " + "." * 32 + ": 12.50",
            "    optimizer " + "." * 39 + ": 3.00"]
    assert Timers(0, "all", torch.device("cpu"))._format(["optimizer"], table[:, 1:])[1] \
        == "    optimizer " + "." * 39 + ": 1.00, 3.00"


def test_memory_report_line_is_megatron_s():
    from megatron.training.logging_utils import format_memory_report, memory_report
    stats = {"allocated_bytes.all.current": 2 * 2**20, "allocated_bytes.all.peak": 3 * 2**20,
             "reserved_bytes.all.current": 4 * 2**20, "reserved_bytes.all.peak": 5 * 2**20}
    assert format_memory_report(3, 1, stats) == (
        "[Rank 3] (after 1 iterations) memory (MB) | allocated: 2.0 | max allocated: 3.0 | "
        "reserved: 4.0 | max reserved: 5.0")
    assert memory_report(0, 1, torch.device("cpu")) is None  # no allocator statistics on CPU


def _block(lines: list[str], header_index: int) -> dict:
    """{timer name: (min, max)} of the timer block starting at ``header_index``."""
    block = {}
    for line in lines[header_index + 1:]:
        match = TIMER_LINE.match(line)
        if not match:
            break
        block[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return block


def test_level_two_adds_forward_and_backward_compute_without_pipelines():
    lines = _run("--timing-log-level 2")
    header = lines.index("(min, max) time across ranks (ms):")
    block = _block(lines, header)
    assert list(block) == ["forward-backward", "all-grads-sync", "optimizer", "batch-generator",
                           "forward-compute", "backward-compute"]  # no pipeline: no p2p timers
    compute = block["forward-compute"][0] + block["backward-compute"][0]
    assert 0 < compute <= block["forward-backward"][0] + 0.02  # printed to 0.01 ms each
