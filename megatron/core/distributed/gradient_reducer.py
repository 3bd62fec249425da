"""Contiguous gradient buffers and an asynchronous all-reduce over them.

:class:`GradientReducer` owns one flat buffer per parameter dtype and makes every parameter's ``.grad``
a view into it, so autograd accumulates micro-batch gradients straight into the buffer and the
reduction is a handful of large all-reduces (one per bucket) instead of one per parameter.

It is deliberately generic: ``GradientReducer(params, group, divide_by)`` reduces *these* parameters
over *this* group. The training loop uses one over all parameters and the data-parallel group; the
pipeline runtime can build one per Chimera stage over the group of that stage's replicas. ``start()``
launches the all-reduces without blocking; ``wait()`` completes them. Gradients are divided by
``divide_by`` before the sum (as Megatron does), which keeps fp16/bf16 buffers from overflowing.

With ``reduce_dtype`` (``--grad-reduce-in-bf16``: ``torch.bfloat16``) each bucket is cast to that dtype
for the collective and the reduced values are cast back into the buffer: the gradients are still
accumulated in their own dtype, only the communication (and the sum) happens in the narrower one.

With ``overlap=True`` (``--overlap-grad-reduce``) the reductions can overlap the backward pass: after
``start_when_ready()``, a bucket's all-reduce is launched from a post-accumulate-grad hook as soon as
the next backward has produced all of its gradients; ``start()`` then launches whatever is left. The
numbers are identical to the non-overlapped reduction. Buckets launch in bucket order (a complete
bucket waits for the earlier ones): the replicas of a stage can produce gradients in different orders
(Chimera's two directions; a full backward on one rank, a weight half on another), and the
collectives of one group must be issued in one order on every rank. The pipeline runtime arms each
module's reducer before that module's last backward op (:mod:`..pipeline_parallel.execution.
interpreter`); without a pipeline it is armed before the last micro-batch's backward.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.reduction import GradientReduction
from megatron.core.distributed.timeouts import awaiting, describe_group

# Elements per all-reduce bucket with --overlap-grad-reduce (Megatron's default is 40M elements;
# smaller buckets start earlier in the backward).
OVERLAP_BUCKET_SIZE = 40_000_000


class _Completed:
    """Stands in for the handle of a reduction that had nothing to communicate."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Completed()


class _Bucket:
    """A contiguous slice of a flat buffer holding the gradients of some parameters."""

    def __init__(self, buffer: torch.Tensor, start: int, end: int, params: list):
        self.data = buffer[start:end]
        self.params = params
        self.handle = None
        self.wire: Optional[torch.Tensor] = None  # the narrower copy being reduced, if any
        self.pending = len(params)  # gradients still to arrive in the armed backward


class GradientReducer(GradientReduction):
    """Flat gradient buffers for ``params`` and their asynchronous all-reduce over ``group``.

    Args:
        params: parameters whose gradients to reduce (those with ``requires_grad``).
        group: process group (``None`` or a one-rank group: only the division happens).
        divide_by: gradients are divided by this before the sum (e.g. the data-parallel size, to
            average; or 1 to sum).
        bucket_size: elements per all-reduce; ``None`` puts each dtype's gradients in one bucket.
        overlap: launch each bucket from the backward pass once armed by ``start_when_ready()``.
        reduce_dtype: the dtype of the collective (``None``: the buffer's own dtype).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group: Any = None,
                 divide_by: float = 1.0, bucket_size: Optional[int] = None,
                 overlap: bool = False, reduce_dtype: Optional[torch.dtype] = None):
        self.params = [p for p in params if p.requires_grad]
        self.reduce_dtype = reduce_dtype
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("GradientReducer got the same parameter twice")
        self.group = group
        self.divide_by = float(divide_by)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._offsets: dict[int, tuple[torch.Tensor, int]] = {}
        self._started = False
        self._armed = False
        self._next_launch = 0  # the first bucket the armed backward has not launched
        # buckets launched from the backward's hooks since the last start_when_ready()
        self.backward_launches = 0
        self._build(bucket_size)
        self.overlap = overlap
        if overlap:
            bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
            for param in self.params:
                param.register_post_accumulate_grad_hook(
                    lambda param, bucket=bucket_of[id(param)]: self._on_grad_ready(bucket))

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
                # No other reference to the view is kept: autograd's AccumulateGrad adopts a
                # returned gradient only while nothing else holds it (else it copies it).
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

    def offset_of(self, param: torch.nn.Parameter) -> int:
        """Where ``param``'s gradient starts in its dtype's flat buffer."""
        return self._offsets[id(param)][1]

    def rebind_all(self) -> None:
        """Make every ``.grad`` a view of its buffer slice again (see :meth:`_rebind`)."""
        for param in self.params:
            self._rebind(param)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def issued(self) -> bool:
        """Started, or every bucket already launched by the armed backward's hooks."""
        return self._started or (self._armed and self._next_launch == len(self.buckets))

    def start_when_ready(self) -> None:
        """Arm the overlap: during the next backward, launch each bucket once its gradients are
        complete (call before the last micro-batch's backward). No-op without ``overlap``."""
        if not self.overlap:
            return
        for param in self.params:
            self._rebind(param)  # the hooks' buckets must hold the gradients autograd writes
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next_launch = 0
        self.backward_launches = 0
        self._armed = True

    def _on_grad_ready(self, bucket: _Bucket) -> None:
        """A parameter's gradient is complete: launch every complete bucket, in bucket order."""
        if not self._armed or bucket.pending <= 0:
            return
        bucket.pending -= 1
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            ready = buckets[self._next_launch]
            self._next_launch += 1
            if ready.handle is None:
                self._launch(ready)
                self.backward_launches += 1

    def _launch(self, bucket: _Bucket) -> None:
        self.observe_local_gradients(bucket.data)
        if self.divide_by != 1.0:
            bucket.data.div_(self.divide_by)
        if group_size(self.group) <= 1:
            bucket.handle = _DONE
        elif self.reduce_dtype is not None and self.reduce_dtype != bucket.data.dtype:
            bucket.wire = bucket.data.to(self.reduce_dtype)
            bucket.handle = dist.all_reduce(bucket.wire, group=self.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.data, group=self.group, async_op=True)

    def start(self) -> None:
        """Divide the gradients and launch the all-reduce of every bucket not yet launched."""
        if self._started:
            raise RuntimeError("GradientReducer.start() called twice without wait()")
        if not self._armed:
            for param in self.params:
                self._rebind(param)
        self._armed = False
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
        self._started = True

    def wait(self) -> None:
        """Complete the reductions (starting them first if nobody did)."""
        if not self._started:
            self.start()
        with awaiting(lambda: "the gradient all-reduce on "
                      + describe_group("gradient-replica", self.group)):
            for bucket in self.buckets:
                if bucket.handle is not None:
                    bucket.handle.wait()
                    bucket.handle = None
                if bucket.wire is not None:
                    bucket.data.copy_(bucket.wire)
                    bucket.wire = None
        self._started = False

    def zero_grad(self) -> None:
        """Zero the buffers (gradients stay views of them)."""
        if self._started:
            raise RuntimeError("zero_grad() while a reduction is in flight; call wait() first")
        for param in self.params:
            self._rebind(param)
        for buffer in self.buffers.values():
            buffer.zero_()


class ExactReductionsFirst(GradientReduction):
    """The frame of a reduction that reduces exactly first and does its own work in ``wait()``
    (A2SGD, top-k, QSGD): ``inner`` sums its parameters' gradients exactly over their direction
    group, ``exact`` (None without) reduces the parameters it leaves exact. Both are
    :class:`GradientReduction` s; their start, zeroing and local-gradient watching are delegated
    here, and :meth:`wait_exact` completes both before the subclass's own work."""

    inner: GradientReducer
    exact: Optional[GradientReducer] = None

    def _reduce_exactly_first(self, params: Iterable[torch.nn.Parameter], direction_group: Any,
                              exact_params: Iterable[torch.nn.Parameter], exact_group: Any,
                              dp_size: int) -> None:
        """Set ``params`` (those that need gradients), ``inner`` and ``exact``."""
        self.params = [p for p in params if p.requires_grad]
        self.inner = GradientReducer(self.params, direction_group, divide_by=1.0)
        kept_exact = [p for p in exact_params if p.requires_grad]
        self.exact = (GradientReducer(kept_exact, exact_group, divide_by=dp_size)
                      if kept_exact else None)

    @property
    def started(self) -> bool:
        return self.inner.started

    def watch_local_gradients(self, observer: Optional[Callable[[Any], None]]) -> None:
        """The exact reductions see the local gradients first (before any compression)."""
        self.inner.watch_local_gradients(observer)
        if self.exact is not None:
            self.exact.watch_local_gradients(observer)

    def start(self) -> None:
        self.inner.start()
        if self.exact is not None:
            self.exact.start()

    def wait_exact(self) -> None:
        self.inner.wait()
        if self.exact is not None:
            self.exact.wait()

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        if self.exact is not None:
            self.exact.zero_grad()
