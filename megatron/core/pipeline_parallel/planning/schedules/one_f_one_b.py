"""1F1B (PipeDream-flush / DAPPLE / Megatron's non-interleaved schedule).

Rank r runs min(D - 1 - r, N) warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards. One pipeline (id 0), stage s on rank s. Peak stored
activations min(D - r, N) on rank r.
"""

from __future__ import annotations

from ..instructions import Instruction, backward, forward
from .family import ScheduleFamily
from .gpipe import fill_and_drain_critical_path
from .layout import single_pipeline_layout


def build_one_f_one_b(pipeline_size: int, num_microbatches: int) -> list[list[Instruction]]:
    """Per-rank instruction lists of 1F1B with D = pipeline_size and N = num_microbatches."""
    schedule = []
    for rank in range(pipeline_size):
        num_warmup = min(pipeline_size - 1 - rank, num_microbatches)
        ops = [forward(0, rank, m) for m in range(num_warmup)]
        for step in range(num_microbatches - num_warmup):
            ops.append(forward(0, rank, num_warmup + step))
            ops.append(backward(0, rank, step))
        ops += [backward(0, rank, m)
                for m in range(num_microbatches - num_warmup, num_microbatches)]
        schedule.append(ops)
    return schedule


ONE_F_ONE_B = ScheduleFamily(
    name="1f1b", description="one forward, one backward (PipeDream-flush / DAPPLE / Megatron)",
    build=build_one_f_one_b,
    layout=lambda pipeline_size: single_pipeline_layout("1f1b", pipeline_size),
    critical_path=fill_and_drain_critical_path)
