"""The runtime without pipeline parallelism: one model chunk, gradient accumulation.

:class:`NoPipelineRuntime` runs each micro-batch's forward and backward in turn (gradients
accumulate), with one data-parallel gradient reduction started after the last backward (or, with
``--overlap-grad-reduce``, bucket by bucket during it).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from megatron.core.distributed.gradient_reducer import OVERLAP_BUCKET_SIZE
from megatron.core.distributed.reducers import BUILTIN_REDUCERS, build_gradient_reducers
from megatron.core.optimizer import default_owns_grad_norm
from megatron.core.pipeline_parallel.execution.instruction_timing import InstructionSeconds

from .protocol import ForwardStepFunc

class NoPipelineRuntime:
    """One model chunk per rank; tensor and data parallelism only (pipeline size 1).

    ``reducer_table`` (a class attribute) holds the gradient reducers ``--dp-gradient-reducer``
    names; a subclass with another table builds reducers of its own.
    """

    reducer_table = BUILTIN_REDUCERS

    @classmethod
    def required_group_ranks(cls, config, layout) -> list:
        return []

    def __init__(self, config, parallel_state, device: torch.device):
        if parallel_state.pp_size != 1:
            raise ValueError("NoPipelineRuntime runs without pipeline parallelism; use the pipeline "
                             "runtime for --pipeline-model-parallel-size > 1")
        self.config = config
        self.parallel_state = parallel_state
        self.device = device
        self._owns = default_owns_grad_norm(parallel_state)

    def build_model_chunks(self, model_provider) -> list[torch.nn.Module]:
        model = model_provider(self.config, self.parallel_state, pre_process=True,
                               post_process=True)
        return [model.to(self.device)]

    def build_gradient_reducers(self, model_chunks) -> list:
        state = self.parallel_state
        parallel = self.config.parallel
        kind = self.reducer_table.get(parallel.dp_gradient_reducer)
        overlap = parallel.overlap_grad_reduce and state.dp_size > 1 and kind.overlaps
        return build_gradient_reducers(
            model_chunks, range(len(model_chunks)), lambda _: state.data_group,
            divide_by=state.dp_size, bucket_size=OVERLAP_BUCKET_SIZE if overlap else None,
            overlap=overlap, sharded=parallel.use_distributed_optimizer, kind=kind,
            parallel=parallel, data_group=state.data_group,
            tensor_parallel=state.tp_size > 1).all

    def owns_grad_norm(self, param: torch.nn.Parameter) -> bool:
        return self._owns(param)

    def describe(self) -> str:
        return (f"> no pipeline parallelism: {self.config.training.num_microbatches} micro-batch(es) "
                f"of gradient accumulation per iteration")

    def report(self, log) -> None:
        """Nothing to add at the end of a run without a pipeline."""

    def forward_backward(self, *, forward_step_func: ForwardStepFunc, model_chunks,
                         microbatches: Sequence[dict], scale_loss: Callable, gradient_reducers,
                         forward_only: bool, autocast: Callable = contextlib.nullcontext,
                         instruction_seconds: Optional[InstructionSeconds] = None,
                         zero_grad: Optional[Callable[[], None]] = None) -> list[dict]:
        return forward_backward_no_pipelining(
            forward_step_func=forward_step_func, model=model_chunks[0],
            microbatches=microbatches, scale_loss=scale_loss,
            gradient_reducers=gradient_reducers, forward_only=forward_only, autocast=autocast,
            instruction_seconds=instruction_seconds, zero_grad=zero_grad)


def _untimed(name: str):
    return contextlib.nullcontext()


def forward_backward_no_pipelining(*, forward_step_func: ForwardStepFunc, model: torch.nn.Module,
                                   microbatches: Sequence[dict], scale_loss: Callable,
                                   gradient_reducers=(), forward_only: bool = False,
                                   autocast: Callable = contextlib.nullcontext,
                                   instruction_seconds: Optional[InstructionSeconds] = None,
                                   zero_grad: Optional[Callable[[], None]] = None
                                   ) -> list[dict]:
    """Forward and backward each micro-batch in turn, accumulating gradients.

    Each micro-batch loss is divided by the number of micro-batches before backward, so the
    accumulated gradient is that of the mean loss. The reducers start after the last backward.
    ``zero_grad`` (unless ``forward_only``) is called first: nothing here waits for anything.
    """
    if zero_grad is not None and not forward_only:
        zero_grad()
    num_microbatches = len(microbatches)
    timed = instruction_seconds.time if instruction_seconds is not None else _untimed
    reported = []
    grad_context = torch.no_grad if forward_only else contextlib.nullcontext
    for index, microbatch in enumerate(microbatches):
        if not forward_only and index == num_microbatches - 1:
            for reducer in gradient_reducers:  # overlap: buckets start during this backward
                reducer.start_when_ready()
        with timed("forward-compute"), grad_context():
            with autocast():
                output, loss_func = forward_step_func(microbatch, model)
            loss, loss_dict = loss_func(output)
        reported.append(loss_dict)
        if not forward_only:
            with timed("backward-compute"):
                scale_loss(loss / num_microbatches).backward()
    if not forward_only:
        for reducer in gradient_reducers:
            reducer.start()
    return reported
