"""Small helpers of tensor parallelism: divisibility, shard arithmetic, gathering shards to full.

A tensor-parallel parameter carries ``tensor_model_parallel=True`` and ``partition_dim`` (the
dimension split evenly over the TP ranks; rank r holds the r-th contiguous block). Everything here
derives from those two attributes, so checkpoints and tests can rebuild the full (unsharded) tensor
of any parameter or gradient without knowing which layer it came from.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator // denominator``, raising a ValueError that names ``what`` when it does not divide."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}; choose sizes so "
                         f"that it divides evenly (e.g. a multiple of {denominator})")
    return numerator // denominator


def tensor_parallel_group(parallel_state) -> Any:
    """The TP process group of ``parallel_state``, or None when TP is 1 (collectives are skipped)."""
    if parallel_state.tp_size == 1:
        return None
    return parallel_state.tensor_group


def group_size_and_rank(group) -> tuple[int, int]:
    """(size, rank within group); (1, 0) for ``None``, the single-rank group."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int,
                   tensor_parallel_size: int) -> int:
    """Megatron's padding: the smallest multiple of divisible_by x TP that holds ``vocab_size``."""
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def shard_of(full: torch.Tensor, partition_dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of ``full`` along ``partition_dim`` (a view)."""
    length = divide(full.shape[partition_dim], size, f"dimension {partition_dim} of size")
    return full.narrow(partition_dim, rank * length, length)


def full_shape(param: torch.Tensor, tensor_parallel_size: int) -> tuple[int, ...]:
    """Shape of the unsharded tensor of which ``param`` is one TP shard."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tensor_parallel_size
    return tuple(shape)


def gather_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in rank order (no autograd)."""
    size, _ = group_size_and_rank(group)
    if size == 1:
        return tensor
    pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
              for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def gather_full_tensor(param_or_grad: torch.Tensor, like: torch.Tensor, parallel_state) -> torch.Tensor:
    """The full tensor of a shard: ``param_or_grad`` has the layout of parameter ``like``.

    Collective over the TP group: every TP rank must call it for the same parameter.
    Replicated parameters are returned unchanged.
    """
    if not getattr(like, "tensor_model_parallel", False):
        return param_or_grad
    return gather_along_dim(param_or_grad, like.partition_dim, tensor_parallel_group(parallel_state))


def gather_full_state(model: torch.nn.Module, parallel_state,
                      gradients: bool = False) -> dict[str, Optional[torch.Tensor]]:
    """``{name: full tensor}`` of every parameter (or its gradient) of ``model``, detached.

    Collective over the TP group. Parameters without a gradient map to None when ``gradients``.
    """
    result: dict[str, Optional[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        value = param.grad if gradients else param.detach()
        if value is None:
            result[name] = None
            continue
        result[name] = gather_full_tensor(value.detach(), param, parallel_state).clone()
    return result
