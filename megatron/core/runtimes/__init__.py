"""Runtimes: how a training step runs its forward and backward passes (see :mod:`.protocol`).

``select_runtime_class(config, registry)`` returns :class:`NoPipelineRuntime` without pipeline
parallelism and :class:`PipelineRuntime` (any schedule family of its registry; a subclass holding
``registry`` when one other than the built-in is given) otherwise.
"""

from __future__ import annotations

from .no_pipeline import NoPipelineRuntime, forward_backward_no_pipelining
from .pipeline import PipelineRuntime
from .protocol import ForwardStepFunc, TrainingRuntime, autocast_context, model_parameters

__all__ = ["ForwardStepFunc", "NoPipelineRuntime", "PipelineRuntime", "TrainingRuntime",
           "autocast_context", "forward_backward_no_pipelining", "model_parameters",
           "select_runtime_class"]


def select_runtime_class(config, registry=None) -> type:
    """The runtime for the config: no pipeline, or the pipeline runtime for PP > 1 planning with
    ``registry`` (None: the built-in schedule families)."""
    if config.parallel.pipeline_model_parallel_size == 1:
        return NoPipelineRuntime
    if registry is None or registry is PipelineRuntime.registry:
        return PipelineRuntime
    return type("PipelineRuntime", (PipelineRuntime,),
                {"registry": registry, "__doc__": PipelineRuntime.__doc__,
                 "__module__": PipelineRuntime.__module__})
