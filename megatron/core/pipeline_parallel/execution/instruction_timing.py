"""Per-instruction timers for ``--timing-log-level 2``: the seconds one rank spent on each kind of
work in an iteration, summed by timer name and handed to the training loop's
:class:`~megatron.training.timers.Timers` (which prints Megatron's ``(min, max)`` block).

Names: ``forward-compute``, ``backward-compute`` (a whole backward), ``backward-input-compute``
and ``backward-weight-compute`` (the halves of a split backward), ``p2p-post`` (posting pipeline
sends and receives), ``p2p-wait`` (blocked on a pipeline message: a consumer waiting for its
input, the end of the iteration waiting for its sends) and ``grad-sync-start`` (launching a
stage's gradient reduction; waiting for it is the loop's ``all-grads-sync``).
On CUDA each reading synchronises the device, so intervals measure the work, not its launch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

INSTRUCTION_TIMERS = ("forward-compute", "backward-compute", "backward-input-compute",
                      "backward-weight-compute", "p2p-post", "p2p-wait", "grad-sync-start")


def synchronized_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after ``device`` finished the work queued so far (on CUDA kernels
    run asynchronously; without the synchronisation an interval would measure their launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class InstructionSeconds:
    """Seconds per timer name, accumulated over one ``forward_backward`` call."""

    device: torch.device
    seconds: dict = field(default_factory=dict)

    def now(self) -> float:
        return synchronized_clock(self.device)

    def add(self, name: str, seconds: float) -> None:
        if name not in INSTRUCTION_TIMERS:
            raise ValueError(f"unknown instruction timer {name!r}; known: {INSTRUCTION_TIMERS}")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(name, self.now() - start)
