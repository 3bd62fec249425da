"""Replica groups of pipeline stages: who holds a copy of which stage, their process groups.

Every stage of a schedule is held by one pipeline rank per pipeline (Chimera: stage s on ranks s
and D-1-s; 2f pipelines: on 2f ranks; one-directional schedules: on one rank), and the whole
pipeline is replicated over the data-parallel ranks. The *replica group* of a stage is every rank
(with this rank's tensor-parallel coordinate) holding a copy of it: for Chimera the 2W ranks of
chimera.md §5, for 1F1B just the data-parallel group. Each stage gets its own labelled process group,
so the all-reduces of different stages can never pair up, whatever order ranks issue them in.

Loss normalisation: each micro-batch's loss is divided by the number of micro-batches of this
data-parallel rank (all pipelines together), so summing a stage's gradient over its replicas and
dividing by the data-parallel size gives exactly the single-process gradient of the mean loss.

Tied embeddings: with a pipeline, the word embedding (stage 0) and the output layer (last stage) are
copies of one weight held by different modules, on different ranks (and on Chimera's end ranks, two
copies on the same rank); their group is every rank holding one. The reductions themselves are built
by :func:`megatron.core.distributed.reducers.build_gradient_reducers`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron.core.distributed.reducers import (ALLREDUCE_REDUCER, ModelReducers,
                                                build_gradient_reducers, is_shared_embedding)
from megatron.core.distributed.reduction import ReducerKind
from megatron.core.parallel_state import GroupSpec, RankCoords

TIED_EMBEDDING_LABEL = "tied-embedding"


def stage_label(stage: int) -> str:
    return f"stage-{stage}-replicas"


def stage_holders(schedule_layout, stage: int) -> list[int]:
    """Pipeline ranks holding a copy of ``stage`` (one per pipeline)."""
    return sorted({schedule_layout.placement(p, stage)
                   for p in range(schedule_layout.num_pipelines)})


def tied_embedding_holders(schedule_layout) -> list[int]:
    """Pipeline ranks holding the word embedding or a tied output-layer copy of it."""
    return sorted(set(stage_holders(schedule_layout, 0))
                  | set(stage_holders(schedule_layout, schedule_layout.num_stages - 1)))


def direction_label(stage: int) -> str:
    return f"stage-{stage}-directions"


def direction_ranks(rank_layout, holders, tp: int, dp: int) -> tuple[int, ...]:
    """The ranks of one data-parallel replica holding a stage (for Chimera: its two directions)."""
    return tuple(sorted(rank_layout.rank(RankCoords(tp, dp, pp)) for pp in holders))


def required_group_specs(schedule_layout, rank_layout, tied: bool,
                         split_directions: bool = False) -> list[GroupSpec]:
    """Every process group the pipeline runtime needs, in the same order on every rank.

    ``split_directions`` (a reducer kind that ``needs_direction_groups``, e.g. A2SGD) adds, per
    stage held by several pipeline ranks, one group per data-parallel replica over its copies of
    the stage."""
    specs = []
    for stage in range(schedule_layout.num_stages):
        holders = stage_holders(schedule_layout, stage)
        for ranks in rank_layout.all_pipeline_ranks_groups(holders):
            specs.append(GroupSpec(stage_label(stage), tuple(ranks)))
        if split_directions and len(holders) > 1:
            for tp in range(rank_layout.tensor_parallel_size):
                for dp in range(rank_layout.data_parallel_size):
                    specs.append(GroupSpec(direction_label(stage),
                                           direction_ranks(rank_layout, holders, tp, dp)))
    if tied and schedule_layout.num_stages > 1:
        for ranks in rank_layout.all_pipeline_ranks_groups(tied_embedding_holders(schedule_layout)):
            specs.append(GroupSpec(TIED_EMBEDDING_LABEL, tuple(ranks)))
    return specs


def stage_group(parallel_state, schedule_layout, stage: int):
    """This rank's process group over the replicas of ``stage`` (None when it has one member)."""
    ranks = parallel_state.layout.pipeline_ranks_group(stage_holders(schedule_layout, stage),
                                                       parallel_state.rank)
    return parallel_state.group_for(ranks, label=stage_label(stage))


def direction_group(parallel_state, schedule_layout, stage: int):
    """This replica's group over its copies of ``stage`` (None for one-directional schedules)."""
    coords = parallel_state.coords
    ranks = direction_ranks(parallel_state.layout, stage_holders(schedule_layout, stage),
                            coords.tp, coords.dp)
    return parallel_state.group_for(ranks, label=direction_label(stage))


def tied_embedding_group(parallel_state, schedule_layout):
    ranks = parallel_state.layout.pipeline_ranks_group(tied_embedding_holders(schedule_layout),
                                                       parallel_state.rank)
    return parallel_state.group_for(ranks, label=TIED_EMBEDDING_LABEL)


def pipeline_reducers(chunks: Sequence[torch.nn.Module], keys: Sequence, parallel_state,
                      schedule_layout, sharded: bool = False,
                      kind: ReducerKind = ALLREDUCE_REDUCER, parallel=None,
                      overlap: bool = False,
                      bucket_size: Optional[int] = None) -> ModelReducers:
    """This rank's reductions: each hosted module over its stage's replica group (built by
    ``kind``, the ``--dp-gradient-reducer`` entry), plus the tied-embedding reduction when the
    embedding and the output layer are different stages. A kind that ``needs_direction_groups``
    gets this replica's group over its copies of the stage as ``request.direction_group()``.
    ``overlap`` / ``bucket_size``: ``--overlap-grad-reduce`` (dropped unless the kind
    ``overlaps``; the interpreter arms each module's reduction before its last backward op)."""
    tied = None
    if schedule_layout.num_stages > 1:
        tied = lambda: tied_embedding_group(parallel_state, schedule_layout)  # noqa: E731
    return build_gradient_reducers(
        chunks, keys, lambda key: stage_group(parallel_state, schedule_layout, key.stage),
        divide_by=parallel_state.dp_size, tied_group=tied, sharded=sharded, kind=kind,
        overlap=overlap, bucket_size=bucket_size,
        parallel=parallel, data_group=parallel_state.data_group,
        direction_group_of=lambda key: direction_group(parallel_state, schedule_layout,
                                                       key.stage),
        tensor_parallel=parallel_state.tp_size > 1)


def grad_norm_owners(chunks: Sequence[torch.nn.Module], keys: Sequence,
                     tp_rank: int) -> set[int]:
    """ids of the parameters whose gradient counts toward the global norm on this rank.

    A stage's replicas hold equal gradients after synchronisation, so only pipeline 0's copy
    counts; the tied embedding counts once, on stage 0 of pipeline 0; a parameter replicated over
    tensor-parallel ranks counts on tensor-parallel rank 0 only.
    """
    owners = set()
    for chunk, key in zip(chunks, keys):
        if key.pipeline != 0:
            continue
        for param in chunk.parameters():
            if is_shared_embedding(param) and key.stage != 0:
                continue
            if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
                owners.add(id(param))
    return owners
