"""Megatron's timers: named wall-clock intervals summed over a log interval and printed as

    (min, max) time across ranks (ms):
        forward-backward ...............................: (1234.56, 1240.03)
        optimizer ......................................: (12.34, 13.01)

``--timing-log-level`` picks which timers run, at Megatron's levels (0, the default: none, so no
block is printed; 1: forward-backward, all-grads-sync and optimizer; 2: also batch-generator and
the per-instruction timers of
:mod:`megatron.core.pipeline_parallel.execution.instruction_timing`: forward-compute,
backward-compute, the split-backward halves, p2p-post, p2p-wait, grad-sync-start; timers that
stayed at zero on every rank, e.g. the split halves without --split-backward, are not printed);
``--timing-log-option`` how ranks are summarised (``max``,
``minmax`` or ``all``). Times are averaged per iteration over the log interval. On CUDA each start
and stop synchronises the device so the intervals measure the work, not the launch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.execution.instruction_timing import (INSTRUCTION_TIMERS,
                                                                          InstructionSeconds,
                                                                          synchronized_clock)

# The level at which each timer starts running, and the block's order: Megatron's (its
# ``timers(name, log_level=...)`` calls and training_log's ``timers_to_log``: forward-backward,
# all-grads-sync and optimizer at 1, batch-generator and the compute/p2p timers at 2; nothing at 0).
TIMER_LEVELS = {"forward-backward": 1, "all-grads-sync": 1, "optimizer": 1, "batch-generator": 2,
                **{name: 2 for name in INSTRUCTION_TIMERS}}


class Timers:
    """Accumulates named intervals between log lines (one instance per run, per rank)."""

    def __init__(self, log_level: int, log_option: str, device: torch.device):
        self.log_level = log_level
        self.log_option = log_option
        self.device = device
        self.elapsed_s: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the body under ``name`` when the timer's level is active."""
        if TIMER_LEVELS.get(name, 2) > self.log_level:
            yield
            return
        start = synchronized_clock(self.device)
        try:
            yield
        finally:
            self.elapsed_s[name] = (self.elapsed_s.get(name, 0.0)
                                    + synchronized_clock(self.device) - start)

    def instruction_clock(self) -> Optional[InstructionSeconds]:
        """A per-instruction accumulator for one ``forward_backward`` (None below level 2)."""
        return InstructionSeconds(self.device) if self.log_level >= 2 else None

    def add(self, seconds_by_name: dict) -> None:
        """Add intervals measured elsewhere (a runtime's per-instruction timers)."""
        for name, seconds in seconds_by_name.items():
            self.elapsed_s[name] = self.elapsed_s.get(name, 0.0) + seconds

    def report(self, iterations: int, world_size: int) -> list[str]:
        """The timer block for the last ``iterations`` iterations (ms per iteration), then reset.

        A collective when ``world_size > 1``: every rank must call it."""
        # Every rank reports the same names (the ones its level runs), so the gather lines up.
        names = [name for name, level in TIMER_LEVELS.items() if level <= self.log_level]
        if not names:  # level 0: no timer ran (the same on every rank: no collective either)
            return []
        mine = torch.tensor([self.elapsed_s.get(name, 0.0) * 1000.0 / iterations
                             for name in names], dtype=torch.float64, device=self.device)
        self.elapsed_s.clear()
        if world_size > 1:
            every = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(every, mine)
        else:
            every = [mine]
        table = torch.stack(every).cpu()
        shown = [column for column in range(len(names)) if table[:, column].any()]
        if not shown:
            return []
        return self._format([names[column] for column in shown], table[:, shown])

    def _format(self, names: list[str], table: torch.Tensor) -> list[str]:
        header = {"max": "max time across ranks (ms):",
                  "minmax": "(min, max) time across ranks (ms):",
                  "all": "times across ranks (ms):"}[self.log_option]
        lines = [header]
        for column, name in enumerate(names):
            values = table[:, column]
            if self.log_option == "max":
                shown = f"{values.max().item():.2f}"
            elif self.log_option == "minmax":
                shown = f"({values.min().item():.2f}, {values.max().item():.2f})"
            else:
                shown = ", ".join(f"{value:.2f}" for value in values.tolist())
            lines.append(f"    {name} {'.' * (48 - len(name))}: {shown}")
        return lines
