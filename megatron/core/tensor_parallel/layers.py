"""Megatron's tensor-parallel layers: vocabulary-parallel embedding, column- and row-parallel linear.

Every parameter created here carries the attributes the rest of the project reads:

- ``tensor_model_parallel`` (bool) and ``partition_dim`` (int, -1 when replicated): how the full
  tensor is split over the TP ranks (contiguous blocks, rank order);
- ``no_weight_decay``: True for biases (norm parameters are marked by the model);
- ``initializer``: ``("normal", std)`` or ``("constant", value)``, the distribution of the FULL
  tensor; :mod:`megatron.core.models.gpt.init` draws it layout-independently.

- ``sequence_parallel_grad``: True for replicated parameters whose gradient is summed over the TP
  ranks inside the backward pass (``mappings.sum_gradient_over_tensor_parallel_ranks``).

With ``sequence_parallel`` (Megatron's sequence parallelism) the activations outside the linear
layers are split along the sequence (dimension 0 of ``[s, b, h]``) over the TP ranks: a
column-parallel layer all-gathers its input along the sequence (reduce-scatter backward; it keeps
only the sequence block for the backward pass and gathers it again there), a
row-parallel layer reduce-scatters its output (all-gather backward), and the row-parallel bias,
added to a sequence shard, has its gradient summed over the TP ranks.

Layers are created with uninitialised storage; the model initialises all parameters at the end.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import (
    all_gather_dim, copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
    reduce_scatter_dim, reduce_scatter_to_sequence_parallel_region,
    sum_gradient_over_tensor_parallel_ranks)
from megatron.core.tensor_parallel.utils import divide, tensor_parallel_group


def set_parameter_attributes(param: torch.nn.Parameter, *, tensor_model_parallel: bool,
                             partition_dim: int = -1, initializer=("constant", 0.0),
                             no_weight_decay: bool = False) -> torch.nn.Parameter:
    """Attach the project's parameter attributes (see the module docstring) and return ``param``."""
    param.tensor_model_parallel = tensor_model_parallel
    param.partition_dim = partition_dim if tensor_model_parallel else -1
    param.initializer = initializer
    param.no_weight_decay = no_weight_decay
    param.shared_embedding = False
    param.sequence_parallel_grad = False
    return param


def _empty_parameter(shape, dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split over the vocabulary: rank r holds rows [r V/tp, (r+1) V/tp).

    Tokens outside the rank's block look up zeros; an all-reduce sums the ranks' partial results
    (with ``reduce_output=False`` the caller reduces them, e.g. reduce-scatters them along the
    sequence under sequence parallelism).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel_state, *,
                 init_std: float, params_dtype=torch.float32, device=None,
                 reduce_output: bool = True):
        super().__init__()
        self.reduce_output = reduce_output
        self.group = tensor_parallel_group(parallel_state)
        self.tp_size = parallel_state.tp_size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_rank = divide(
            num_embeddings, parallel_state.tp_size,
            "padded vocabulary size (make it a multiple of make-vocab-size-divisible-by x TP)")
        self.vocab_start = parallel_state.tp_rank * self.num_embeddings_per_rank
        self.weight = set_parameter_attributes(
            _empty_parameter((self.num_embeddings_per_rank, embedding_dim), params_dtype, device),
            tensor_model_parallel=True, partition_dim=0, initializer=("normal", init_std))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.vocab_start
        not_mine = (local_ids < 0) | (local_ids >= self.num_embeddings_per_rank)
        embedded = F.embedding(local_ids.masked_fill(not_mine, 0), self.weight)
        embedded = embedded.masked_fill(not_mine.unsqueeze(-1), 0.0)
        if not self.reduce_output:
            return embedded
        return reduce_from_tensor_parallel_region(embedded, self.group)


class _SequenceParallelLinear(torch.autograd.Function):
    """``all_gather(x) W^T + b`` that stores only ``x``, this rank's block of the sequence, and
    all-gathers it again in the backward pass (Megatron's choice: the full-sequence input of a
    column-parallel layer is never kept between forward and backward). Backward: the input
    gradient is reduce-scattered along the sequence; the weight and bias gradients are local.

    Under autocast (``--bf16`` / ``--fp16``) ``F.linear`` computes in the autocast dtype, but the
    backward runs outside autocast with the saved fp32 weight: it computes in the gradient's dtype
    (the output's) and casts each gradient back to its input's dtype, as autograd does for the
    casts inside the plain layer (a bf16 gradient times the fp32 weight used to fail)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_dim(x, 0, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        compute_dtype = grad.dtype  # the forward's: the autocast dtype under mixed precision
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_dim(grad.matmul(weight.to(compute_dtype)).to(x.dtype), 0,
                                        ctx.group)
        if ctx.needs_input_grad[1]:
            full = all_gather_dim(x, 0, ctx.group).to(compute_dtype)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(
                full.reshape(-1, full.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(dim=0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with A's output rows (and b) split over the TP ranks.

    The input is replicated (its gradient is all-reduced on the way back), or with
    ``sequence_parallel`` this rank's block of the sequence (dimension 0), all-gathered here; the
    output is this rank's block of the last dimension, or the full output when ``gather_output``.
    ``forward(x, weight=...)`` uses an external weight (the tied word embedding for the logits).

    ``stacked`` > 1 makes the layer ``stacked`` independent matrices of ``output_size`` rows each
    (SwiGLU's gate and up projections): the weight is ``[stacked, output_size/tp, input_size]``
    split along dimension 1, so every rank holds its block of each matrix and the full tensor does
    not depend on the TP size; the output is the ranks' blocks side by side, ``[..., stacked *
    output_size/tp]`` (Megatron's per-rank layout of the fused SwiGLU ``linear_fc1``).
    """

    def __init__(self, input_size: int, output_size: int, parallel_state, *, bias: bool,
                 init_std: Optional[float], gather_output: bool = False,
                 sequence_parallel: bool = False, stacked: int = 1,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        self.group = tensor_parallel_group(parallel_state)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and self.group is not None
        self.output_size_per_rank = divide(output_size, parallel_state.tp_size,
                                           "output size of a column-parallel linear layer")
        stack = (stacked,) if stacked > 1 else ()
        partition_dim = len(stack)
        if init_std is None:  # the weight is supplied at call time
            self.weight = None
        else:
            self.weight = set_parameter_attributes(
                _empty_parameter(stack + (self.output_size_per_rank, input_size), params_dtype,
                                 device),
                tensor_model_parallel=True, partition_dim=partition_dim,
                initializer=("normal", init_std))
        self.bias = None
        if bias:
            self.bias = set_parameter_attributes(
                _empty_parameter(stack + (self.output_size_per_rank,), params_dtype, device),
                tensor_model_parallel=True, partition_dim=partition_dim, no_weight_decay=True)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        if weight is None:
            weight = self.weight
        if weight is None:
            raise ValueError("this ColumnParallelLinear has no weight of its own; pass weight=")
        bias: Optional[torch.Tensor] = self.bias
        if weight.dim() == 3:  # stacked matrices side by side
            weight = weight.reshape(-1, weight.shape[-1])
            bias = None if bias is None else bias.reshape(-1)
        if self.sequence_parallel:
            output = _SequenceParallelLinear.apply(x, weight, bias, self.group)
        else:
            output = F.linear(copy_to_tensor_parallel_region(x, self.group), weight, bias)
        if self.gather_output:
            output = gather_from_tensor_parallel_region(output, self.group)
        return output


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with A's input columns split over the TP ranks.

    The input is this rank's block of the last dimension (the output of a column-parallel layer);
    partial products are all-reduced (with ``sequence_parallel``: reduce-scattered along the
    sequence, dimension 0) and the replicated bias is added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, parallel_state, *, bias: bool,
                 init_std: float, sequence_parallel: bool = False, params_dtype=torch.float32,
                 device=None):
        super().__init__()
        self.group = tensor_parallel_group(parallel_state)
        self.tp_size = parallel_state.tp_size
        self.sequence_parallel = sequence_parallel and self.group is not None
        self.input_size_per_rank = divide(input_size, parallel_state.tp_size,
                                          "input size of a row-parallel linear layer")
        self.weight = set_parameter_attributes(
            _empty_parameter((output_size, self.input_size_per_rank), params_dtype, device),
            tensor_model_parallel=True, partition_dim=1, initializer=("normal", init_std))
        self.bias = None
        if bias:
            self.bias = set_parameter_attributes(
                _empty_parameter((output_size,), params_dtype, device),
                tensor_model_parallel=False, no_weight_decay=True)
            self.bias.sequence_parallel_grad = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # nothing to reduce: the bias joins the matmul (one fused op)
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight),
                                                                self.group, 0)
            if self.bias is None:
                return output
            return output + sum_gradient_over_tensor_parallel_ranks(self.bias, self.group)
        output = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.group)
        return output if self.bias is None else output + self.bias
