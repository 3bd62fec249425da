"""Model statistics for the log line: ``--log-params-norm`` and ``--log-num-zeros-in-grad``.

Both count each parameter exactly once over the model-parallel ranks with the optimizer's gradient
norm ownership rule (a tensor-parallel shard from every TP rank, a replicated parameter from one, the
pipeline's duplicates as the runtime says; see :mod:`megatron.core.optimizer.clip_grads`), and sum
over the tensor- and pipeline-parallel groups. Data-parallel replicas are identical and not summed.
They are collectives: call them on every rank.
"""

from __future__ import annotations

import torch

from megatron.core.distributed.collectives import all_reduce_over


def _reduce_over_model_parallel(value: torch.Tensor, parallel_state) -> float:
    all_reduce_over(value, [parallel_state.tensor_group, parallel_state.pipeline_group])
    return float(value.item())


def _owned(optimizer) -> list[torch.nn.Parameter]:
    return [param for param in optimizer.params if optimizer.owns_grad_norm(param)]


def _device(params, parallel_state) -> torch.device:
    if params:
        return params[0].device
    return torch.device("cuda", torch.cuda.current_device()) \
        if parallel_state.backend == "nccl" else torch.device("cpu")


def params_norm(optimizer, parallel_state) -> float:
    """L2 norm of all model parameters (Megatron's ``params norm``), identical on every rank."""
    optimizer.finish_parameter_gather()
    params = _owned(optimizer)
    squares = torch.zeros(1, dtype=torch.float64, device=_device(params, parallel_state))
    for param in params:
        squares += param.detach().double().pow(2).sum()
    return _reduce_over_model_parallel(squares, parallel_state) ** 0.5


def num_zeros_in_grads(optimizer, parallel_state) -> float:
    """Number of gradient elements that are exactly zero (Megatron's ``num zeros``)."""
    params = [param for param in _owned(optimizer) if param.grad is not None]
    zeros = torch.zeros(1, dtype=torch.float64, device=_device(params, parallel_state))
    for param in params:
        zeros += (param.grad == 0).sum().double()
    return _reduce_over_model_parallel(zeros, parallel_state)
