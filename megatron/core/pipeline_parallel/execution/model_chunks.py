"""Which layers each pipeline stage holds, and building a rank's model chunks.

A schedule's :class:`~megatron.core.pipeline_parallel.planning.schedules.ScheduleLayout` says which
(pipeline, stage) modules a pipeline rank hosts: one stage for GPipe and 1F1B, v chunks for
interleaved 1F1B, two stages for Chimera (down stage r and up stage D-1-r), 2f for 2f pipelines.
The model's ``num_layers`` (every model config section declares it, see
``megatron/training/model_spec.py``) are split over the stages, evenly or as the uneven-stage
flags say (:mod:`~megatron.core.pipeline_parallel.planning.stage_split`); the model provider builds
stage ``layer_range`` and is told whether the stage is the first (``pre_process``: e.g. GPT's
embedding) or the last (``post_process``: e.g. GPT's final norm, output layer and loss). A provider
must build every chunk exactly like the same layers of the single-process model (layout-independent
initialisation), so the replicas of a Chimera stage start equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron.core.pipeline_parallel.planning.stage_split import config_stage_layer_ranges


@dataclass(frozen=True)
class ModuleKey:
    """A (pipeline, stage) module of a schedule: the weights one instruction uses."""

    pipeline: int
    stage: int


def build_model_chunks(model_provider: Callable, config, parallel_state, schedule_layout,
                       device: torch.device) -> tuple[list[torch.nn.Module], list[ModuleKey]]:
    """This rank's chunks, in the schedule's chunk order, and the module key of each.

    ``model_provider(config, parallel_state, *, pre_process, post_process, layer_range)`` builds
    one chunk (a ``ModelSpec``'s ``model_provider``); ``config.model.num_layers`` is the number
    of layers split over the stages (``config.parallel``'s uneven-stage flags say how).
    """
    chunks, keys = [], []
    stage_layers = config_stage_layer_ranges(config, schedule_layout.num_stages)
    for pipeline, stage in schedule_layout.hosted(parallel_state.pp_rank):
        layers = stage_layers[stage]
        chunk = model_provider(config, parallel_state,
                               pre_process=schedule_layout.is_first_stage(stage),
                               post_process=schedule_layout.is_last_stage(stage),
                               layer_range=layers)
        chunks.append(chunk.to(device))
        keys.append(ModuleKey(pipeline, stage))
    return chunks, keys
