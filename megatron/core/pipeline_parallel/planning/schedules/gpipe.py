"""GPipe: every rank runs all forwards, then all backwards (micro-batches in order).

One pipeline (id 0), stage s on rank s. Peak stored activations N on every rank.
"""

from __future__ import annotations

from ..instructions import Instruction, backward, forward
from .family import ScheduleFamily
from .layout import single_pipeline_layout


def build_gpipe(pipeline_size: int, num_microbatches: int) -> list[list[Instruction]]:
    """Per-rank instruction lists of GPipe with D = pipeline_size and N = num_microbatches."""
    return [[forward(0, rank, m) for m in range(num_microbatches)]
            + [backward(0, rank, m) for m in range(num_microbatches)]
            for rank in range(pipeline_size)]


GPIPE = ScheduleFamily(
    name="gpipe", description="all forwards, then all backwards (Huang et al.)",
    build=build_gpipe, layout=lambda pipeline_size: single_pipeline_layout("gpipe", pipeline_size))
