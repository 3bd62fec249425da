"""Gradient reduction for the distributed optimizer: reduce-scatter, a shard per rank, all-gather.

:class:`ShardedGradientReducer` implements :class:`~.reducers.GradientReduction` for the parameters
of one model chunk over the group of all replicas of its stage (the data-parallel group, and under
Chimera every pipeline's copy times data parallel: 2W ranks). The chunk's parameters and gradients
become views of flat buffers, one per *segment* (parameters that share a weight-decay setting and a
tensor-parallel kind, and, for ``--decoupled-lr``, whether it is marked
``is_embedding_or_output_parameter``, and for ``--use-mup`` its ``mup_class``), each padded to a multiple of the group size R. ``start()`` reduce-scatters
each gradient buffer, so rank k of the group receives the sum over replicas (divided by
``divide_by``) of elements ``[k L/R, (k+1) L/R)``; the distributed optimizer steps only those
elements (its *shard*: 1/R of the stage's fp32 weights, gradients and Adam state) and
:meth:`gather_parameters` all-gathers the updated shards into every replica's parameter buffer.

Each shard is exposed as one ``torch.nn.Parameter`` per segment (a view of this rank's slice of the
parameter buffer, with the reduced gradient shard as its ``.grad``) carrying the segment's
``no_weight_decay``, ``tensor_model_parallel`` and ``is_embedding_or_output_parameter``
attributes, so the optimizer's parameter groups and
the global norm treat it like the parameters it is cut from. AdamW is elementwise, so updating the
shards equals updating whole parameters (the numbers match the replicated optimizer; tested).
With ``reduce_dtype`` (``--grad-reduce-in-bf16``) the reduce-scatter runs on a bf16 copy of each
gradient buffer and the reduced shard is cast back to the gradient's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.reduction import GradientReduction
from megatron.core.distributed.timeouts import awaiting, describe_group


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rank_in(group: Any) -> int:
    return dist.get_rank(group) if group_size(group) > 1 else 0


def _segment_key(param: torch.nn.Parameter) -> tuple:
    no_decay = getattr(param, "no_weight_decay", None)
    no_decay = no_decay if no_decay is not None else param.ndim < 2
    return (bool(no_decay), bool(getattr(param, "tensor_model_parallel", False)), param.dtype,
            bool(getattr(param, "is_embedding_or_output_parameter", False)),
            str(getattr(param, "mup_class", "")))


@dataclass
class _Segment:
    """Parameters of one kind, their flat buffers, and this rank's shard of them."""

    params: list
    param_buffer: torch.Tensor
    grad_buffer: torch.Tensor
    shard: torch.nn.Parameter
    handle: Any = None
    wire: Any = None  # (input, output) in the reduce dtype while a narrower reduce-scatter runs


class ShardedGradientReducer(GradientReduction):
    """Reduce-scatter of a chunk's gradients over its replicas; see the module docstring."""

    shards_gradients = True  # a distributed optimizer steps its ``shards``

    def __init__(self, params: Iterable[torch.nn.Parameter], group: Any = None,
                 divide_by: float = 1.0, stage_id: Hashable = 0,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.params = [p for p in params if p.requires_grad]
        self.reduce_dtype = reduce_dtype  # --grad-reduce-in-bf16: the reduce-scatter's dtype
        self.stage_id = stage_id  # the same on every replica: names the stage in checkpoints
        self.group = group
        self.divide_by = float(divide_by)
        self.size = group_size(group)
        self.rank = _rank_in(group)
        by_kind: dict = {}
        for param in self.params:
            by_kind.setdefault(_segment_key(param), []).append(param)
        self.segments = [self._build_segment(params) for _, params in sorted(
            by_kind.items(), key=lambda item: (item[0][0], item[0][1], str(item[0][2]), item[0][3],
                                               item[0][4]))]
        self._started = False

    def _build_segment(self, params: list) -> _Segment:
        total = sum(p.numel() for p in params)
        padded = -(-total // self.size) * self.size
        reference = params[0]
        param_buffer = torch.zeros(padded, dtype=reference.dtype, device=reference.device)
        grad_buffer = torch.zeros(padded, dtype=reference.dtype, device=reference.device)
        offset = 0
        for param in params:
            count = param.numel()
            param_buffer[offset:offset + count].copy_(param.data.reshape(-1))
            param.data = param_buffer[offset:offset + count].view_as(param)
            old_grad = param.grad
            param.grad = grad_buffer[offset:offset + count].view_as(param)
            if old_grad is not None:
                param.grad.copy_(old_grad)
            offset += count
        length = padded // self.size
        shard = torch.nn.Parameter(param_buffer[self.rank * length:(self.rank + 1) * length])
        shard.grad = torch.zeros_like(shard)
        shard.no_weight_decay = _segment_key(reference)[0]
        shard.tensor_model_parallel = _segment_key(reference)[1]
        shard.is_embedding_or_output_parameter = _segment_key(reference)[3]
        if _segment_key(reference)[4]:  # --use-mup: the class of the segment's parameters
            shard.mup_class = _segment_key(reference)[4]
        return _Segment(params, param_buffer, grad_buffer, shard)

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """(start, length, unpadded total) of this rank's shard in each segment's flat buffer."""
        return [(self.rank * segment.shard.numel(), segment.shard.numel(),
                 sum(p.numel() for p in segment.params)) for segment in self.segments]

    @property
    def shards(self) -> list[torch.nn.Parameter]:
        """This rank's shard of each segment (what the distributed optimizer steps)."""
        return [segment.shard for segment in self.segments]

    @property
    def started(self) -> bool:
        return self._started

    def _rebind_grads(self) -> None:
        """Gradients must stay views of the buffer (someone may have replaced ``.grad``)."""
        for segment in self.segments:
            offset = 0
            for param in segment.params:
                view = segment.grad_buffer[offset:offset + param.numel()].view_as(param)
                if param.grad is None:
                    view.zero_()
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view
                offset += param.numel()

    def start_when_ready(self) -> None:
        """No overlap with the backward: the reduce-scatter starts at :meth:`start`."""

    def start(self) -> None:
        """Divide the gradients and launch the reduce-scatter of every segment."""
        if self._started:
            raise RuntimeError("ShardedGradientReducer.start() called twice without wait()")
        self._rebind_grads()
        for segment in self.segments:
            self.observe_local_gradients(segment.grad_buffer)
            if self.divide_by != 1.0:
                segment.grad_buffer.div_(self.divide_by)
            narrow = self.reduce_dtype is not None and \
                self.reduce_dtype != segment.grad_buffer.dtype
            if self.size > 1 and narrow:
                segment.wire = (segment.grad_buffer.to(self.reduce_dtype),
                                torch.empty(segment.shard.grad.shape, dtype=self.reduce_dtype,
                                            device=segment.shard.grad.device))
                segment.handle = _REDUCE_SCATTER(segment.wire[1], segment.wire[0],
                                                 group=self.group, async_op=True)
            elif self.size > 1:
                segment.handle = _REDUCE_SCATTER(segment.shard.grad, segment.grad_buffer,
                                                 group=self.group, async_op=True)
            else:
                segment.shard.grad.copy_(segment.grad_buffer)
        self._started = True

    def wait(self) -> None:
        """Complete the reduce-scatter (starting it first if nobody did)."""
        if not self._started:
            self.start()
        with awaiting(lambda: "the gradient reduce-scatter on "
                      + describe_group("gradient-replica", self.group)):
            for segment in self.segments:
                if segment.handle is not None:
                    segment.handle.wait()
                    segment.handle = None
                if segment.wire is not None:
                    segment.shard.grad.copy_(segment.wire[1])
                    segment.wire = None
        self._started = False

    def start_parameter_gather(self) -> list:
        """Launch the all-gathers that give every replica every rank's updated shard (after the
        optimizer step); returns the handles to wait for. Asynchronous, so ranks may gather the
        stages they share in any order without waiting on each other."""
        if self.size == 1:
            return []
        return [_ALL_GATHER(segment.param_buffer, segment.shard.detach().clone(),
                            group=self.group, async_op=True) for segment in self.segments]

    def zero_grad(self) -> None:
        if self._started:
            raise RuntimeError("zero_grad() while a reduction is in flight; call wait() first")
        self._rebind_grads()
        for segment in self.segments:
            segment.grad_buffer.zero_()
            segment.shard.grad.zero_()

    def shard_nbytes(self) -> int:
        """Bytes of fp32 weights this rank steps (Adam keeps two more such tensors)."""
        return sum(s.shard.numel() * s.shard.element_size() for s in self.segments)
