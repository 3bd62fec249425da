"""Tensor parallelism: region mappings, parallel layers, vocab-parallel cross entropy, dropout RNG."""

from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, set_parameter_attributes)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region, sum_gradient_over_tensor_parallel_ranks)
from megatron.core.tensor_parallel.random import (
    CounterBasedDropout, DropoutContext, stable_seed)
from megatron.core.tensor_parallel.utils import (
    divide, full_shape, gather_full_state, gather_full_tensor, pad_vocab_size, shard_of,
    tensor_parallel_group)

__all__ = [
    "ColumnParallelLinear", "CounterBasedDropout", "DropoutContext", "RowParallelLinear",
    "VocabParallelEmbedding", "copy_to_tensor_parallel_region", "divide", "full_shape",
    "gather_from_sequence_parallel_region", "gather_from_tensor_parallel_region",
    "gather_full_state", "gather_full_tensor", "pad_vocab_size",
    "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region",
    "set_parameter_attributes", "shard_of", "stable_seed",
    "sum_gradient_over_tensor_parallel_ranks", "tensor_parallel_group",
    "vocab_parallel_cross_entropy",
]
