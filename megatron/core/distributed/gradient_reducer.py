"""Contiguous gradient buffers and an asynchronous all-reduce over them.

:class:`GradientReducer` owns one flat buffer per parameter dtype and makes every parameter's ``.grad``
a view into it, so autograd accumulates micro-batch gradients straight into the buffer and the
reduction is a handful of large all-reduces (one per bucket) instead of one per parameter.

It is deliberately generic: ``GradientReducer(params, group, divide_by)`` reduces *these* parameters
over *this* group. The training loop uses one over all parameters and the data-parallel group; the
pipeline runtime can build one per Chimera stage over the group of that stage's replicas. ``start()``
launches the all-reduces without blocking; ``wait()`` completes them. Gradients are divided by
``divide_by`` before the sum (as Megatron does), which keeps fp16/bf16 buffers from overflowing.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size


class _Bucket:
    """A contiguous slice of a flat buffer holding the gradients of some parameters."""

    def __init__(self, buffer: torch.Tensor, start: int, end: int, params: list):
        self.data = buffer[start:end]
        self.params = params
        self.handle = None


class GradientReducer:
    """Flat gradient buffers for ``params`` and their asynchronous all-reduce over ``group``.

    Args:
        params: parameters whose gradients to reduce (those with ``requires_grad``).
        group: process group (``None`` or a one-rank group: only the division happens).
        divide_by: gradients are divided by this before the sum (e.g. the data-parallel size, to
            average; or 1 to sum).
        bucket_size: elements per all-reduce; ``None`` puts each dtype's gradients in one bucket.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group: Any = None,
                 divide_by: float = 1.0, bucket_size: Optional[int] = None):
        self.params = [p for p in params if p.requires_grad]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("GradientReducer got the same parameter twice")
        self.group = group
        self.divide_by = float(divide_by)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._offsets: dict[int, tuple[torch.Tensor, int]] = {}
        self._started = False
        self._build(bucket_size)

    def _build(self, bucket_size: Optional[int]) -> None:
        by_dtype: dict[tuple, list] = {}
        for param in self.params:
            by_dtype.setdefault((param.dtype, param.device), []).append(param)
        for (dtype, device), params in by_dtype.items():
            # Reverse order: gradients appear roughly last-layer first during backward, so the
            # first buckets are the first ready (matters when reductions overlap the backward).
            params = params[::-1]
            total = sum(p.numel() for p in params)
            buffer = torch.zeros(total, dtype=dtype, device=device)
            self.buffers[dtype] = buffer
            offset, bucket_start, bucket_params = 0, 0, []
            for param in params:
                self._offsets[id(param)] = (buffer, offset)
                old_grad = param.grad
                param.grad = buffer[offset:offset + param.numel()].view_as(param)
                if old_grad is not None:
                    param.grad.copy_(old_grad)
                offset += param.numel()
                bucket_params.append(param)
                if bucket_size is not None and offset - bucket_start >= bucket_size:
                    self.buckets.append(_Bucket(buffer, bucket_start, offset, bucket_params))
                    bucket_start, bucket_params = offset, []
            if bucket_params:
                self.buckets.append(_Bucket(buffer, bucket_start, offset, bucket_params))

    def _rebind(self, param: torch.nn.Parameter) -> None:
        """Make ``param.grad`` a view of its buffer slice again, keeping any value it holds.

        Someone may have replaced ``.grad`` (e.g. ``zero_grad(set_to_none=True)``); the buffer is
        the source of truth for the reduction, so copy such a gradient back in.
        """
        buffer, offset = self._offsets[id(param)]
        view = buffer[offset:offset + param.numel()].view_as(param)
        grad = param.grad
        if grad is not None and grad.data_ptr() == view.data_ptr():
            return
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        param.grad = view

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        """Divide the gradients and launch the all-reduce of every bucket without blocking."""
        if self._started:
            raise RuntimeError("GradientReducer.start() called twice without wait()")
        for param in self.params:
            self._rebind(param)
        reduce = group_size(self.group) > 1
        for bucket in self.buckets:
            if self.divide_by != 1.0:
                bucket.data.div_(self.divide_by)
            if reduce:
                bucket.handle = dist.all_reduce(bucket.data, group=self.group, async_op=True)
        self._started = True

    def wait(self) -> None:
        """Complete the reductions (starting them first if nobody did)."""
        if not self._started:
            self.start()
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        self._started = False

    def zero_grad(self) -> None:
        """Zero the buffers (gradients stay views of them)."""
        if self._started:
            raise RuntimeError("zero_grad() while a reduction is in flight; call wait() first")
        for param in self.params:
            self._rebind(param)
        for buffer in self.buffers.values():
            buffer.zero_()
