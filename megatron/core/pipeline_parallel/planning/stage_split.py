"""How many transformer layers each pipeline stage holds (Megatron-LM's rules, even or uneven).

A schedule has ``num_stages`` model stages in model order: D for GPipe, 1F1B and Chimera (whose
rank r holds stage r of the down pipeline and stage D-1-r of the up one), D x v for interleaved
1F1B (virtual stage c x D + r on rank r). Stage s sits at pipeline position ``s mod D``.

* Default: ``num_layers`` split evenly over all stages.
* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers T``: position 0
  holds F layers, position D-1 holds T, the rest split evenly over the middle positions; with v
  virtual stages each position's layers split evenly over its v chunks (Megatron's
  ``get_num_layers_to_build`` / ``get_transformer_layer_offset``).
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding and the loss count as one layer each; ``num_layers`` + those split evenly over all
  stages, and the first (last) stage builds one transformer layer fewer.

No torch import: validation and the planners use it before any process exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"


@dataclass(frozen=True)
class StageSplit:
    """The flags that make pipeline stages uneven (all unset: every stage equal)."""

    first: Optional[int] = None
    last: Optional[int] = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @classmethod
    def from_parallel_config(cls, parallel) -> "StageSplit":
        """The split ``config.parallel`` asks for (a section without these fields: even)."""
        return cls(getattr(parallel, "decoder_first_pipeline_num_layers", None),
                   getattr(parallel, "decoder_last_pipeline_num_layers", None),
                   bool(getattr(parallel, "account_for_embedding_in_pipeline_split", False)),
                   bool(getattr(parallel, "account_for_loss_in_pipeline_split", False)))

    @property
    def is_even(self) -> bool:
        return self == StageSplit()


def _split_evenly(total: int, parts: int, what: str, fix: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) cannot be split evenly over {parts}; {fix}")
    return total // parts


def _first_last_counts(num_layers: int, pipeline_size: int, chunks: int,
                       split: StageSplit) -> list[int]:
    if split.account_for_embedding or split.account_for_loss:
        raise ValueError(f"{FIRST_FLAG} / {LAST_FLAG} cannot be combined with {EMBEDDING_FLAG} / "
                         f"{LOSS_FLAG} (as in Megatron-LM); give the stage sizes one way")
    given = {0: split.first} if split.first is not None else {}
    if split.last is not None:
        given[pipeline_size - 1] = split.last
    for flag, value in ((FIRST_FLAG, split.first), (LAST_FLAG, split.last)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    if len(given) < (split.first is not None) + (split.last is not None):
        raise ValueError(f"{FIRST_FLAG} and {LAST_FLAG} name the same stage with "
                         f"--pipeline-model-parallel-size 1; drop them without a pipeline")
    middle_positions = pipeline_size - len(given)
    middle_layers = num_layers - sum(given.values())
    flags = " and ".join(flag for flag, value in ((FIRST_FLAG, split.first),
                                                 (LAST_FLAG, split.last)) if value is not None)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_positions):
        raise ValueError(
            f"{flags} leave {middle_layers} of --num-layers {num_layers} for {middle_positions} "
            f"middle pipeline stage(s); every middle stage needs at least one layer and none may "
            f"be left over: change {flags} or --num-layers")
    per_middle = 0
    if middle_positions:
        per_middle = _split_evenly(
            middle_layers, middle_positions,
            f"the layers left after {flags} for the {middle_positions} middle pipeline stages",
            f"choose {flags} so that --num-layers minus them is a multiple of "
            f"{middle_positions}")
    per_position = [given.get(position, per_middle) for position in range(pipeline_size)]
    if chunks > 1:
        for position, count in enumerate(per_position):
            name = {0: FIRST_FLAG, pipeline_size - 1: LAST_FLAG}.get(position) \
                if position in given else "a middle stage's layers"
            _split_evenly(count, chunks, f"{name} of pipeline stage {position}",
                          f"with --num-virtual-stages-per-pipeline-rank {chunks} every pipeline "
                          f"stage's layers must be a multiple of {chunks}")
    return [per_position[stage % pipeline_size] // chunks
            for stage in range(pipeline_size * chunks)]


def stage_layer_counts(num_layers: int, pipeline_size: int, num_stages: int,
                       split: StageSplit = StageSplit()) -> tuple[int, ...]:
    """Transformer layers of each of the ``num_stages`` model stages, in model order.

    ``num_stages`` is ``pipeline_size`` or a multiple of it (interleaved virtual stages). Raises
    ValueError naming the flags and the fix when the layers do not split that way.
    """
    if pipeline_size < 1 or num_stages % pipeline_size:
        raise ValueError(f"{num_stages} stages are not a multiple of the pipeline size "
                         f"{pipeline_size}")
    chunks = num_stages // pipeline_size
    if split.first is not None or split.last is not None:
        return tuple(_first_last_counts(num_layers, pipeline_size, chunks, split))
    if split.is_even:
        per_stage = _split_evenly(
            num_layers, num_stages, "--num-layers", f"use a multiple of "
            f"{num_stages} layers, change the pipeline size / virtual stages, or give "
            f"{FIRST_FLAG} / {LAST_FLAG} for uneven stages")
        return (per_stage,) * num_stages
    units = num_layers + split.account_for_embedding + split.account_for_loss
    flags = " and ".join(flag for flag, on in ((EMBEDDING_FLAG, split.account_for_embedding),
                                               (LOSS_FLAG, split.account_for_loss)) if on)
    extra = units - num_layers
    valid = [count * num_stages - extra for count in (units // num_stages, units // num_stages + 1)
             if count * num_stages - extra > 0]
    per_stage = _split_evenly(
        units, num_stages, f"--num-layers {num_layers} plus one layer for each of {flags}",
        f"with {num_stages} (virtual) pipeline stages use a --num-layers that is {extra} short "
        f"of a multiple of {num_stages} (e.g. {' or '.join(map(str, valid))}), or change the "
        f"pipeline size / virtual stages")
    counts = [per_stage] * num_stages
    counts[0] -= split.account_for_embedding
    counts[-1] -= split.account_for_loss
    if min(counts) < 0:
        raise ValueError(f"{flags} with {num_stages} stages of {per_stage} leave no room for "
                         f"the embedding and the loss; use fewer pipeline stages")
    return tuple(counts)


def stage_layer_ranges(counts: tuple[int, ...]) -> tuple[range, ...]:
    """Global layer indices of each stage for ``counts`` layers per stage (model order)."""
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def config_stage_layer_ranges(config, num_stages: int) -> tuple[range, ...]:
    """Global layer indices of each of ``num_stages`` stages for a validated config (its
    ``model.num_layers``, pipeline size and uneven-stage flags)."""
    parallel = config.parallel
    return stage_layer_ranges(stage_layer_counts(
        config.model.num_layers, parallel.pipeline_model_parallel_size, num_stages,
        StageSplit.from_parallel_config(parallel)))
