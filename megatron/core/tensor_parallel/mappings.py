"""Autograd functions that move activations into and out of the tensor-parallel region.

Megatron's four conjugate pairs (forward / backward):

========================================  ===================  ===================
function                                  forward              backward
========================================  ===================  ===================
copy_to_tensor_parallel_region            identity             all-reduce
reduce_from_tensor_parallel_region        all-reduce           identity
scatter_to_tensor_parallel_region         keep own last-dim    all-gather last dim
gather_from_tensor_parallel_region        all-gather last dim  keep own block
========================================  ===================  ===================

and the three of sequence parallelism, along a sequence dimension ``dim``:

==========================================  ====================  ====================
function                                    forward               backward
==========================================  ====================  ====================
scatter_to_sequence_parallel_region         keep own dim block    all-gather dim
gather_from_sequence_parallel_region        all-gather dim        reduce-scatter dim
reduce_scatter_to_sequence_parallel_region  reduce-scatter dim    all-gather dim
==========================================  ====================  ====================

Each takes the TP process group explicitly (``None`` or a group of one rank makes it the identity);
use :func:`megatron.core.tensor_parallel.utils.tensor_parallel_group` to get it from a ParallelState.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import divide, group_size_and_rank


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    # Reduce a fresh copy: autograd may hand the same gradient buffer to several consumers.
    result = tensor.contiguous().clone()
    dist.all_reduce(result, group=group)
    return result


def _split_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    size, rank = group_size_and_rank(group)
    length = divide(tensor.shape[-1], size, "last dimension")
    return tensor.narrow(-1, rank * length, length).contiguous()


def _gather_last_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    size, _ = group_size_and_rank(group)
    pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
              for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _split_last_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _gather_last_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def _is_trivial(group) -> bool:
    return group_size_and_rank(group)[0] == 1


def copy_to_tensor_parallel_region(tensor: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` backward."""
    return tensor if _is_trivial(group) else _CopyToRegion.apply(tensor, group)


def reduce_from_tensor_parallel_region(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over ``group`` forward; identity backward."""
    return tensor if _is_trivial(group) else _ReduceFromRegion.apply(tensor, group)


def scatter_to_tensor_parallel_region(tensor: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's block of the last dimension forward; all-gather the gradient backward."""
    return tensor if _is_trivial(group) else _ScatterToRegion.apply(tensor, group)


def gather_from_tensor_parallel_region(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dimension forward; keep this rank's block of the gradient backward."""
    return tensor if _is_trivial(group) else _GatherFromRegion.apply(tensor, group)


def _split_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    size, rank = group_size_and_rank(group)
    length = divide(tensor.shape[dim], size, f"dimension {dim} (the sequence, split over TP)")
    return tensor.narrow(dim, rank * length, length).contiguous()


def all_gather_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order (no autograd)."""
    size, _ = group_size_and_rank(group)
    pieces = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
              for _ in range(size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def reduce_scatter_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's block of ``dim`` (NCCL's reduce-scatter; on gloo,
    which has none, an all-reduce followed by the slice: same values, more traffic)."""
    if dist.get_backend(group) == "nccl":
        size, _ = group_size_and_rank(group)
        moved = tensor.movedim(dim, 0).contiguous()
        output = moved.new_empty((divide(moved.shape[0], size, "sequence dimension"),)
                                 + tuple(moved.shape[1:]))
        dist.reduce_scatter_tensor(output, moved, group=group)
        return output.movedim(0, dim).contiguous()
    return _split_dim(_all_reduce(tensor, group), dim, group)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_dim(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(tensor, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


def scatter_to_sequence_parallel_region(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Keep this rank's block of ``dim`` forward; all-gather the gradient along ``dim`` backward."""
    return tensor if _is_trivial(group) else _ScatterToSequence.apply(tensor, dim, group)


def gather_from_sequence_parallel_region(tensor: torch.Tensor, group,
                                         dim: int = 0) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter the gradient along ``dim`` backward."""
    return tensor if _is_trivial(group) else _GatherFromSequence.apply(tensor, dim, group)


def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor, group,
                                               dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's block of ``dim`` forward; all-gather backward."""
    return tensor if _is_trivial(group) else _ReduceScatterToSequence.apply(tensor, dim, group)


def sum_gradient_over_tensor_parallel_ranks(param: torch.Tensor, group) -> torch.Tensor:
    """``param`` itself forward; its gradient all-reduced over ``group`` backward.

    For a parameter replicated over TP whose ranks see different parts of the data (norms and the
    row-parallel bias under sequence parallelism: different tokens; the query/key norms: different
    heads): each rank's partial gradient becomes the sum, the gradient of the unsplit model.
    """
    return copy_to_tensor_parallel_region(param, group)
