"""Gradient synchronisation: contiguous gradient buffers and their asynchronous all-reduce."""

from megatron.core.distributed.collectives import all_reduce_over, all_reduce_world, group_size
from megatron.core.distributed.gradient_reducer import GradientReducer

__all__ = ["GradientReducer", "all_reduce_over", "all_reduce_world", "group_size"]
