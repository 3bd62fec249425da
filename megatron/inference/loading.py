"""Load a checkpoint of any parallel layout into one tensor-parallel model (pipeline gathered).

Every rank file of the iteration is read and merged to full weights
(:func:`~megatron.training.checkpoint_conversion.merge_full_state`); each process then builds the
whole model (all layers, no pipeline split) at its tensor-parallel size and keeps its block of each
tensor. Dropout is off (``eval()``).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.utils import shard_of
from megatron.training.checkpoint_conversion import merge_full_state, read_checkpoint


def model_from_full_state(full: dict, config, parallel_state: Optional[ParallelState] = None,
                          device=None, params_dtype=torch.float32):
    """The whole GPT model at ``parallel_state``'s TP size holding ``full`` (``{name: tensor}``)."""
    from megatron.core.models.gpt.model import GPTModel

    parallel_state = parallel_state or ParallelState.single_process()
    model = GPTModel(config.model, None, parallel_state, config.training.seed,
                     params_dtype=params_dtype, device=device)
    tp_rank, tp_size = parallel_state.tp_rank, parallel_state.tp_size
    expected = set(model.state_dict())
    if expected != set(full):
        missing, unexpected = sorted(expected - set(full))[:3], sorted(set(full) - expected)[:3]
        raise ValueError(f"the checkpoint does not hold this model's parameters (missing "
                         f"{missing}, unexpected {unexpected})")
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[name]
            if getattr(param, "tensor_model_parallel", False):
                value = shard_of(value, param.partition_dim, tp_rank, tp_size)
            param.copy_(value)
    return model.eval()


def load_model(load: str, parallel_state: Optional[ParallelState] = None,
               iteration: Optional[int] = None, device=None):
    """(model, config) of ``load``'s iteration (default: the tracker's), for inference."""
    source = read_checkpoint(load, iteration)
    config = source.config
    config.parallel.tensor_model_parallel_size = (parallel_state or
                                                  ParallelState.single_process()).tp_size
    full = merge_full_state(source)
    return model_from_full_state(full, config, parallel_state, device), config
