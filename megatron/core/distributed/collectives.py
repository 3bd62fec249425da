"""Small collective helpers shared by the optimizer, the gradient reducers and the training loop.

Process groups come from the explicit :class:`~megatron.core.parallel_state.ParallelState` handle; a
``None`` group or a group of one rank means "nothing to reduce", so single-process code runs the same
path without ``torch.distributed`` being initialised.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.timeouts import awaiting, describe_group


def group_size(group: Any) -> int:
    """Number of ranks in ``group``; 1 for ``None`` or when torch.distributed is not running."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_over(tensor: torch.Tensor, groups: Iterable[Optional[Any]],
                    op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place over each group in turn.

    Reducing over orthogonal groups one after another (e.g. tensor- then pipeline-parallel) equals one
    reduction over their product, without needing a process group for that product.
    """
    for group in groups:
        if group_size(group) > 1:
            with awaiting(lambda: "an all-reduce on " + describe_group("process", group)):
                dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_world(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place over every rank (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with awaiting(lambda: "an all-reduce on " + describe_group("world", dist.group.WORLD)):
            dist.all_reduce(tensor, op=op)
    return tensor
