"""How one training step runs its forward and backward passes: the pluggable part of the loop.

The training loop (:mod:`megatron.training.training`) is free of schedule-specific code. It asks a
*runtime* to build the model chunks this rank holds, to create the gradient reducers, to say which
parameters count toward the global gradient norm, and to run the forward/backward passes over an
iteration's micro-batches. The loop then waits for the reducers, and the optimizer unscales, checks
for overflow, clips and steps.

:class:`NoPipelineRuntime` is the runtime without pipeline parallelism (one model chunk, gradient
accumulation over micro-batches, a data-parallel all-reduce started after the last backward). A
pipeline runtime provides the same methods (see :class:`TrainingRuntime`) and runs a schedule instead,
starting its own reducers (data-parallel, Chimera replica groups) where the schedule puts them.

Loss normalisation contract (so every layout equals single-process training on the same batch): a
micro-batch's loss is the mean of its per-token loss over the loss mask, divided by the number of
micro-batches this data-parallel rank processes per iteration; reducers average over data-parallel
ranks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence

import torch

from megatron.core.distributed import GradientReducer
from megatron.core.optimizer import default_owns_grad_norm

# forward_step_func(microbatch, model) -> (output_tensor, loss_func); loss_func(output_tensor) ->
# (scalar loss, {"lm loss": detached scalar, ...}), as in Megatron-LM's pretrain_gpt.py.
ForwardStepFunc = Callable[[dict, torch.nn.Module], tuple]

# Elements per all-reduce bucket with --overlap-grad-reduce (Megatron's default is 40M elements;
# smaller buckets start earlier in the backward).
OVERLAP_BUCKET_SIZE = 40_000_000


class TrainingRuntime(Protocol):
    """What the training loop needs from a runtime (duck-typed; this class documents it).

    ``required_group_ranks(config, layout)`` is a static method listing extra process groups (as rank
    lists) that must exist before the runtime is constructed; :func:`megatron.training.initialize.
    initialize_megatron` creates them. The runtime is constructed as ``Runtime(config,
    parallel_state, device)``.
    """

    @staticmethod
    def required_group_ranks(config, layout) -> list[list[int]]: ...

    def build_model_chunks(self, model_provider) -> list[torch.nn.Module]:
        """Build (on ``device``) the model chunks this rank holds."""

    def build_gradient_reducers(self, model_chunks) -> list[GradientReducer]:
        """Reducers covering every trainable parameter of ``model_chunks``."""

    def owns_grad_norm(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` contributes to the global gradient norm on this rank."""

    def forward_backward(self, *, forward_step_func: ForwardStepFunc, model_chunks,
                         microbatches: Sequence[dict], scale_loss: Callable, gradient_reducers,
                         forward_only: bool, autocast: Callable) -> list[dict]:
        """Run the micro-batches; return the loss dicts of the micro-batches whose loss this rank
        computed. Unless ``forward_only``, every reducer has been started on return."""

    def describe(self) -> str:
        """Log line(s) naming how this runtime runs a step (printed once at start-up)."""

    def report(self, log) -> None:
        """Collective, after training: end-of-run figures, logged where ``log`` is not None."""


def autocast_context(training_config, device: torch.device) -> Callable:
    """A factory of the forward-pass autocast context for the run's precision.

    Parameters and gradients stay float32; ``--bf16`` / ``--fp16`` run the forward under
    ``torch.autocast`` with that dtype.
    """
    if training_config.bf16:
        dtype = torch.bfloat16
    elif training_config.fp16:
        dtype = torch.float16
    else:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def model_parameters(model_chunks) -> list[torch.nn.Parameter]:
    """Trainable parameters of all chunks, each once, in chunk order."""
    seen, params = set(), []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


class NoPipelineRuntime:
    """One model chunk per rank; tensor and data parallelism only (pipeline size 1)."""

    @staticmethod
    def required_group_ranks(config, layout) -> list[list[int]]:
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

    def build_gradient_reducers(self, model_chunks) -> list[GradientReducer]:
        overlap = self.config.parallel.overlap_grad_reduce and self.parallel_state.dp_size > 1
        return [GradientReducer(model_parameters(model_chunks), self.parallel_state.data_group,
                                divide_by=self.parallel_state.dp_size,
                                bucket_size=OVERLAP_BUCKET_SIZE if overlap else None,
                                overlap=overlap)]

    def owns_grad_norm(self, param: torch.nn.Parameter) -> bool:
        return self._owns(param)

    def describe(self) -> str:
        return (f"> no pipeline parallelism: {self.config.training.num_microbatches} micro-batch(es) "
                f"of gradient accumulation per iteration")

    def report(self, log) -> None:
        """Nothing to add at the end of a run without a pipeline."""

    def forward_backward(self, *, forward_step_func: ForwardStepFunc, model_chunks,
                         microbatches: Sequence[dict], scale_loss: Callable, gradient_reducers,
                         forward_only: bool, autocast: Callable = contextlib.nullcontext
                         ) -> list[dict]:
        return forward_backward_no_pipelining(
            forward_step_func=forward_step_func, model=model_chunks[0],
            microbatches=microbatches, scale_loss=scale_loss,
            gradient_reducers=gradient_reducers, forward_only=forward_only, autocast=autocast)


def forward_backward_no_pipelining(*, forward_step_func: ForwardStepFunc, model: torch.nn.Module,
                                   microbatches: Sequence[dict], scale_loss: Callable,
                                   gradient_reducers=(), forward_only: bool = False,
                                   autocast: Callable = contextlib.nullcontext) -> list[dict]:
    """Forward and backward each micro-batch in turn, accumulating gradients.

    Each micro-batch loss is divided by the number of micro-batches before backward, so the
    accumulated gradient is that of the mean loss. The reducers start after the last backward.
    """
    num_microbatches = len(microbatches)
    reported = []
    grad_context = torch.no_grad if forward_only else contextlib.nullcontext
    for index, microbatch in enumerate(microbatches):
        if not forward_only and index == num_microbatches - 1:
            for reducer in gradient_reducers:  # overlap: buckets start during this backward
                reducer.start_when_ready()
        with grad_context():
            with autocast():
                output, loss_func = forward_step_func(microbatch, model)
            loss, loss_dict = loss_func(output)
        reported.append(loss_dict)
        if not forward_only:
            scale_loss(loss / num_microbatches).backward()
    if not forward_only:
        for reducer in gradient_reducers:
            reducer.start()
    return reported
