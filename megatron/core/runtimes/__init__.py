"""Runtimes: how a training step runs its forward and backward passes (see :mod:`.protocol`).

``select_runtime_class(config)`` returns :class:`NoPipelineRuntime` without pipeline parallelism
and :class:`PipelineRuntime` (any schedule family of its registry) otherwise.
"""

from __future__ import annotations

from .no_pipeline import NoPipelineRuntime, forward_backward_no_pipelining
from .pipeline import PipelineRuntime
from .protocol import ForwardStepFunc, TrainingRuntime, autocast_context, model_parameters

__all__ = ["ForwardStepFunc", "NoPipelineRuntime", "PipelineRuntime", "TrainingRuntime",
           "autocast_context", "forward_backward_no_pipelining", "model_parameters",
           "select_runtime_class"]


def select_runtime_class(config) -> type:
    """The runtime for the config: no pipeline, or the pipeline runtime for PP > 1."""
    if config.parallel.pipeline_model_parallel_size == 1:
        return NoPipelineRuntime
    return PipelineRuntime
