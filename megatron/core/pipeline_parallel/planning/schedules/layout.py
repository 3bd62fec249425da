"""Where the stages of a schedule live and which samples each micro-batch covers.

:class:`ScheduleLayout` is the static description of a schedule family that the runtime needs
before it builds a model: how many pipelines and stages there are, which pipeline rank hosts
(pipeline, stage), the order of the model chunks on a rank, and how an instruction's micro-batch
index maps to the samples of this data-parallel rank's share of the global batch.
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from fractions import Fraction


@dataclass(frozen=True)
class ScheduleLayout:
    """Static placement of a schedule's stages on pipeline ranks.

    Attributes:
        name: schedule family name (used in messages only).
        pipeline_size: number of pipeline ranks D.
        num_stages: stages per pipeline (D, or D * num_model_chunks for interleaved 1F1B).
        placements: ``placements[pipeline][stage]`` is the pipeline rank hosting that stage.
        microbatch_fraction: size of an instruction micro-batch relative to --micro-batch-size
            (1, or 1/2 for Chimera backward halving).
        doubling_unit: instruction micro-batches per doubling unit (2D for Chimera forward
            doubling and backward halving, 0 otherwise). Inside complete doubling units the
            forwards of a module run in adjacent pairs, one doubled step each; the lowering
            receives both inputs of a pair before its first forward, so they travel together.
    """

    name: str
    pipeline_size: int
    num_stages: int
    placements: tuple[tuple[int, ...], ...]
    microbatch_fraction: Fraction = Fraction(1)
    doubling_unit: int = 0

    @property
    def num_pipelines(self) -> int:
        return len(self.placements)

    @property
    def has_stage_replicas(self) -> bool:
        """Whether each stage has copies on other pipeline ranks (Chimera), so the gradient-sync
        policy decides when their all-reduce starts; otherwise syncs run at the end."""
        return self.num_pipelines > 1

    def placement(self, pipeline: int, stage: int) -> int:
        """Pipeline rank hosting ``stage`` of ``pipeline``."""
        return self.placements[pipeline][stage]

    @cached_property
    def _modules_by_rank(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        modules = [[] for _ in range(self.pipeline_size)]
        for pipeline, stages in enumerate(self.placements):
            for stage, host in enumerate(stages):
                modules[host].append((pipeline, stage))
        return tuple(tuple(rank_modules) for rank_modules in modules)

    @cached_property
    def _chunks(self) -> dict:
        return {module: chunk for rank_modules in self._modules_by_rank
                for chunk, module in enumerate(rank_modules)}

    def hosted(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The (pipeline, stage) modules on ``rank``, in chunk order.

        Chunk order is by pipeline id then stage, so for interleaved 1F1B chunk c is virtual stage
        c * D + rank (Megatron's model_chunk_id) and for Chimera with f = 1 chunk 0 is the down
        stage ``rank`` and chunk 1 the up stage ``D - 1 - rank``.
        """
        return self._modules_by_rank[rank]

    def chunk(self, pipeline: int, stage: int) -> int:
        """Index of (pipeline, stage) in ``hosted(placement(pipeline, stage))``."""
        return self._chunks[(pipeline, stage)]

    def is_first_stage(self, stage: int) -> bool:
        """The first stage reads its input from the data (no activation is received)."""
        return stage == 0

    def is_last_stage(self, stage: int) -> bool:
        """The last stage computes the loss (no activation sent, no gradient received)."""
        return stage == self.num_stages - 1

    def num_schedule_microbatches(self, num_microbatches: int) -> int:
        """Number of instruction micro-batches for ``num_microbatches`` micro-batches of size B.

        Equal to ``num_microbatches`` except for backward halving, where it is twice as many
        half micro-batches.
        """
        count = num_microbatches / self.microbatch_fraction
        assert count.denominator == 1
        return int(count)

    def microbatch_samples(self, microbatch: int, micro_batch_size: int) -> range:
        """Sample positions, within this data-parallel rank's share of the global batch, that the
        instruction micro-batch ``microbatch`` covers: ``[k * b, (k + 1) * b)`` with
        ``b = micro_batch_size * microbatch_fraction``.

        The union over all instruction micro-batches 0 .. num_schedule_microbatches(N) - 1 is
        exactly ``range(N * micro_batch_size)``, the rank's share.
        """
        size = micro_batch_size * self.microbatch_fraction
        if size.denominator != 1:
            raise ValueError(
                f"--micro-batch-size {micro_batch_size} cannot be split into instruction "
                f"micro-batches of {self.microbatch_fraction} of it for the {self.name} schedule; "
                f"use an even --micro-batch-size")
        size = int(size)
        return range(microbatch * size, (microbatch + 1) * size)


def single_pipeline_layout(name: str, pipeline_size: int) -> ScheduleLayout:
    """One pipeline of D stages, stage s on rank s (GPipe, 1F1B and their relatives)."""
    return ScheduleLayout(name, pipeline_size, pipeline_size, (tuple(range(pipeline_size)),))
