"""The stage contract: what a model chunk must offer to run under any pipeline schedule.

The interpreter knows nothing about GPT. It runs a chunk through the user's
``forward_step_func(microbatch, chunk) -> (output, loss_func)`` (Megatron's signature) and needs
two things from the chunk itself, declared by :class:`PipelineStageModule`:

* ``set_input_tensor(tensor)``: the activation received from the previous stage, or None. A chunk
  that is not a first stage computes its next forward from this tensor instead of the data it is
  called with (Megatron's convention); a first stage ignores it and reads the micro-batch.
* ``input_activation_shape(microbatch)``: the shape of the activation this chunk receives for
  ``microbatch`` (so a receive buffer can be posted before the data arrives).

Everything else follows from the schedule's layout: the chunk of a *last* stage returns what
``loss_func`` turns into ``(loss, report dict)``; every other chunk returns the activation that is
sent on, whose gradient comes back with the same shape. The model provider builds a chunk as
``model_provider(config, parallel_state, *, pre_process, post_process, layer_range)`` (first stage,
last stage, and the global indices of the layers it holds; see ``model_chunks``).

GPT implements the contract in :class:`megatron.core.models.gpt.GPTModel`;
``tests/distributed/test_stage_contract.py`` runs a model that is not a GPT.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class PipelineStageModule(Protocol):
    """A model chunk the pipeline interpreter can run (see the module docstring)."""

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        """Use ``tensor`` (the previous stage's activation) as the input of the next forward."""

    def input_activation_shape(self, microbatch: dict) -> tuple[int, ...]:
        """Shape of the activation this chunk receives for ``microbatch``."""


def check_stage_module(chunk: torch.nn.Module) -> None:
    """Raise TypeError naming what is missing when ``chunk`` does not implement the contract."""
    missing = [name for name in ("set_input_tensor", "input_activation_shape")
               if not callable(getattr(chunk, name, None))]
    if missing:
        raise TypeError(f"{type(chunk).__name__} cannot run as a pipeline stage: it lacks "
                        f"{', '.join(missing)} (see megatron/core/pipeline_parallel/execution/"
                        f"stage.py for the stage contract)")
