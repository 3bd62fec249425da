"""Model statistics for the log line: ``--log-params-norm`` and ``--log-num-zeros-in-grad``.

Both count each element of the model exactly once over the ranks, as the optimizer says
(:meth:`~megatron.core.optimizer.optimizer.MegatronOptimizer.counted_once`): with the gradient norm's
ownership rule (a tensor-parallel shard from every TP rank, a replicated parameter from one, the
pipeline's duplicates as the runtime says; see :mod:`megatron.core.optimizer.clip_grads`) summed
over the tensor- and pipeline-parallel groups, data-parallel replicas being identical; with
``--use-distributed-optimizer`` the shards each rank steps, summed over every rank.
They are collectives: call them on every rank.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.core.distributed.collectives import all_reduce_over


def _device(tensors: list, parallel_state) -> torch.device:
    if tensors:
        return tensors[0].device
    return torch.device("cuda", torch.cuda.current_device()) \
        if parallel_state.backend == "nccl" else torch.device("cpu")


Contribution = Callable[[torch.Tensor, Optional[torch.Tensor]], "torch.Tensor | float"]


def _sum_over_model(optimizer, contribution: Contribution, parallel_state) -> float:
    """Sum of ``contribution(value, grad)`` over the optimizer's :meth:`counted_once` parts."""
    total = 0.0
    for part in optimizer.counted_once():
        value = torch.zeros(1, dtype=torch.float64, device=_device(part.values, parallel_state))
        for tensor, grad in zip(part.values, part.grads):
            value += contribution(tensor, grad)
        total += float(all_reduce_over(value, part.groups).item())
    return total


def params_norm(optimizer, parallel_state) -> float:
    """L2 norm of all model parameters (Megatron's ``params norm``), identical on every rank."""
    optimizer.finish_parameter_gather()
    return _sum_over_model(optimizer, lambda value, _: value.double().pow(2).sum(),
                           parallel_state) ** 0.5


def num_zeros_in_grads(optimizer, parallel_state) -> float:
    """Number of gradient elements that are exactly zero (Megatron's ``num zeros``)."""
    return _sum_over_model(
        optimizer, lambda _, grad: (grad == 0).sum().double() if grad is not None else 0.0,
        parallel_state)
