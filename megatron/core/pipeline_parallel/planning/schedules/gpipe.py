"""GPipe: every rank runs all forwards, then all backwards (micro-batches in order).

One pipeline (id 0), stage s on rank s. Peak stored activations N on every rank.
"""

from __future__ import annotations

from ..instructions import Instruction, backward, forward
from .family import ScheduleFamily
from .layout import single_pipeline_layout


def fill_and_drain_critical_path(pipeline_size: int, num_microbatches: int) -> tuple[int, int]:
    """(Cf, Cb) = (N + D - 1, N + D - 1): the first rank's N ops plus the fill (and drain) of
    the other D - 1 stages."""
    return num_microbatches + pipeline_size - 1, num_microbatches + pipeline_size - 1


def build_gpipe(pipeline_size: int, num_microbatches: int) -> list[list[Instruction]]:
    """Per-rank instruction lists of GPipe with D = pipeline_size and N = num_microbatches."""
    return [[forward(0, rank, m) for m in range(num_microbatches)]
            + [backward(0, rank, m) for m in range(num_microbatches)]
            for rank in range(pipeline_size)]


GPIPE = ScheduleFamily(
    name="gpipe", description="all forwards, then all backwards (Huang et al.)",
    build=build_gpipe, layout=lambda pipeline_size: single_pipeline_layout("gpipe", pipeline_size),
    critical_path=fill_and_drain_critical_path)
