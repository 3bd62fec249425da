"""The runtime seam: how one training step runs its forward and backward passes.

The training loop (:mod:`megatron.training.training`) is free of schedule-specific code. It asks a
*runtime* to build the model chunks this rank holds, to create the gradient reductions, to say which
parameters count toward the global gradient norm, and to run the forward/backward passes over an
iteration's micro-batches. The loop then waits for the reductions, and the optimizer unscales, checks
for overflow, clips and steps. Two runtimes implement :class:`TrainingRuntime`:
:class:`~.no_pipeline.NoPipelineRuntime` (TP and DP only) and :class:`~.pipeline.PipelineRuntime`
(every schedule family of the registry); :func:`megatron.core.runtimes.select_runtime_class` picks one.
Both build their gradient reductions with the kind ``--dp-gradient-reducer`` names in their
``reducer_table`` class attribute (:data:`~megatron.core.distributed.reducers.BUILTIN_REDUCERS`).

Loss normalisation contract (so every layout equals single-process training on the same batch): a
micro-batch's loss is the mean of its per-token loss over the loss mask, divided by the number of
micro-batches this data-parallel rank processes per iteration; reducers average over data-parallel
ranks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Protocol, Sequence

import torch

from megatron.core.distributed.reducers import GradientReduction
from megatron.core.pipeline_parallel.execution.instruction_timing import InstructionSeconds

# forward_step_func(microbatch, model) -> (output_tensor, loss_func); loss_func(output_tensor) ->
# (scalar loss, {"lm loss": detached scalar, ...}), as in Megatron-LM's pretrain_gpt.py.
ForwardStepFunc = Callable[[dict, torch.nn.Module], tuple]


class TrainingRuntime(Protocol):
    """What the training loop needs from a runtime.

    ``required_group_ranks(config, layout)`` is a class method listing extra process groups (as rank
    lists or ``GroupSpec``) that must exist before the runtime is constructed; :func:`megatron.training.initialize.
    initialize_megatron` creates them. The runtime is constructed as ``Runtime(config,
    parallel_state, device)``.
    """

    @classmethod
    def required_group_ranks(cls, config, layout) -> list: ...

    def build_model_chunks(self, model_provider) -> list[torch.nn.Module]:
        """Build (on ``device``) the model chunks this rank holds."""

    def build_gradient_reducers(self, model_chunks) -> list[GradientReduction]:
        """Reducers covering every trainable parameter of ``model_chunks``."""

    def owns_grad_norm(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` contributes to the global gradient norm on this rank."""

    def forward_backward(self, *, forward_step_func: ForwardStepFunc, model_chunks,
                         microbatches: Sequence[dict], scale_loss: Callable, gradient_reducers,
                         forward_only: bool, autocast: Callable,
                         instruction_seconds: Optional[InstructionSeconds] = None,
                         zero_grad: Optional[Callable[[], None]] = None) -> list[dict]:
        """Run the micro-batches; return the loss dicts of the micro-batches whose loss this rank
        computed. Unless ``forward_only``, every reducer has been started on return. With
        ``instruction_seconds`` (``--timing-log-level 2``), add the time of each kind of work to it
        (:mod:`~megatron.core.pipeline_parallel.execution.instruction_timing`). ``zero_grad``
        (unless ``forward_only``) is called once before any gradient is accumulated, where the
        runtime has time for it (a pipeline: at the rank's first wait for a message or first
        backward op, whichever comes first)."""

    def describe(self) -> str:
        """Log line(s) naming how this runtime runs a step (printed once at start-up)."""

    def report(self, log) -> None:
        """Collective, after training: end-of-run figures, logged where ``log`` is not None."""


# Helpers the runtimes and the training loop share.

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
