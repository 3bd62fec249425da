"""A2SGD: two-level gradient averaging as the data-parallel reduction (O(1) numbers per worker).

A2SGD (Bhattacharya, Yu, Chowdhury; arXiv 2006.07405) replaces the data-parallel all-reduce of the
whole gradient by an all-reduce of four numbers per *segment* (the whole model portion a reducer
owns by default, as in the paper; or each bucket / each tensor). Per step, on data-parallel rank i:

1. ``p = g + e`` (``g`` this replica's gradient, ``e`` the error kept from the last step, both in
   loss-unscaled units);
2. the sum and count of the non-negative entries of ``p`` and of the negative entries, all-reduced
   over the data-parallel group: global means ``m+`` and ``m-``;
3. the applied gradient is ``m+`` where ``p >= 0`` and ``m-`` elsewhere; ``e <- p - applied``.

The new error is *staged* and committed by ``after_step(ok)`` only when the optimizer stepped (a
loss-scale overflow or a non-finite norm discards it). Replicas apply different updates and drift,
so ``synchronize()`` averages the parameters and the optimizer state exactly over the data-parallel
group; the training loop calls it every ``sync_interval`` (``--a2sgd-sync-interval``) iterations
and before every checkpoint and evaluation. All of this goes through the lifecycle of the
:class:`~.reduction.GradientReduction` seam; the error buffers are the reducer's ``state_dict()``,
which checkpoints keep per data-parallel rank. :data:`A2SGD_REDUCER` is the
``--dp-gradient-reducer a2sgd`` entry of :data:`~.reducers.BUILTIN_REDUCERS`.

Exactness is kept where the issue asks: gradients of one replica's copies of a stage (Chimera's two
pipeline directions) are summed exactly over the *direction group* first (ranks of this data-parallel
replica holding the stage), then A2SGD runs over the data-parallel group (same pipeline rank, other
replicas); with tensor parallelism the tensor-parallel-replicated parameters (layer norms, biases of
row-parallel layers) are all-reduced exactly over the stage's full replica group, since their A2SGD
means would otherwise differ between tensor-parallel ranks. Tied embeddings keep their exact
:class:`~.reducers.TiedEmbeddingReducer`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.error_feedback import ErrorFeedback
from megatron.core.distributed.gradient_reducer import GradientReducer
from megatron.core.distributed.reduction import (ChunkReductionRequest, GradientReduction,
                                                 ReducerKind)

GRANULARITIES = ("model", "bucket", "tensor")


def segment_bounds(sizes: Sequence[int], granularity: str, bucket_size: int) -> list[tuple]:
    """(start, end) element ranges of the flat buffer, one per averaged segment."""
    total = sum(sizes)
    if granularity == "model":
        return [(0, total)] if total else []
    if granularity == "tensor":
        bounds, offset = [], 0
        for size in sizes:
            bounds.append((offset, offset + size))
            offset += size
        return bounds
    if granularity == "bucket":
        return [(start, min(start + bucket_size, total)) for start in range(0, total, bucket_size)]
    raise ValueError(f"unknown A2SGD granularity {granularity!r}; use one of {GRANULARITIES}")


def local_statistics(values: torch.Tensor, bounds: Sequence[tuple]) -> torch.Tensor:
    """float64 [segments, 4]: (sum, count) of the non-negative entries, then of the negative ones."""
    stats = torch.zeros(len(bounds), 4, dtype=torch.float64, device=values.device)
    for index, (start, end) in enumerate(bounds):
        segment = values[start:end].double()
        positive = segment >= 0
        stats[index, 0] = segment[positive].sum()
        stats[index, 1] = positive.sum()
        stats[index, 2] = segment[~positive].sum()
        stats[index, 3] = (~positive).sum()
    return stats


def two_level_values(values: torch.Tensor, stats: torch.Tensor, bounds: Sequence[tuple]
                     ) -> torch.Tensor:
    """The applied gradient: each segment's global positive mean where ``values >= 0``, its global
    negative mean elsewhere (a mean over no entries is 0)."""
    positive_mean = stats[:, 0] / stats[:, 1].clamp(min=1)
    negative_mean = stats[:, 2] / stats[:, 3].clamp(min=1)
    applied = torch.empty_like(values)
    for index, (start, end) in enumerate(bounds):
        segment = values[start:end]
        applied[start:end] = torch.where(segment >= 0, positive_mean[index].to(values.dtype),
                                         negative_mean[index].to(values.dtype))
    return applied


class A2SGDReducer(GradientReduction):
    """A :class:`~.reducers.GradientReduction` of one model chunk with A2SGD over data parallel.

    Args:
        params: the chunk's parameters averaged with A2SGD.
        direction_group: group of this replica's copies of the stage (Chimera's pipeline
            directions; None for one-directional schedules): gradients are summed exactly over it.
        data_group: the data-parallel group the two means are all-reduced over.
        exact_params, exact_group, dp_size: parameters all-reduced exactly over ``exact_group``
            (divided by ``dp_size``): tensor-parallel-replicated ones.
        granularity: ``model`` (paper, default), ``bucket`` or ``tensor``.
        bucket_size: elements per segment for ``bucket``.
        sync_interval: ``synchronize()`` every this many iterations (``--a2sgd-sync-interval``).
    """

    has_state = True  # the error buffers

    def __init__(self, params: Iterable[torch.nn.Parameter], *, direction_group: Any = None,
                 data_group: Any = None, exact_params: Iterable[torch.nn.Parameter] = (),
                 exact_group: Any = None, dp_size: int = 1, granularity: str = "model",
                 bucket_size: int = 1_000_000, sync_interval: int = 0):
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown A2SGD granularity {granularity!r}; use one of "
                             f"{GRANULARITIES}")
        self.params = [p for p in params if p.requires_grad]
        self.inner = GradientReducer(self.params, direction_group, divide_by=1.0)
        exact_params = [p for p in exact_params if p.requires_grad]
        self.exact = (GradientReducer(exact_params, exact_group, divide_by=dp_size)
                      if exact_params else None)
        self.data_group = data_group
        self.granularity = granularity
        self.bucket_size = int(bucket_size)
        self.sync_interval = int(sync_interval)
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self._optimizer_state: Optional[dict] = None  # the torch optimizer's state, once attached
        self.feedback = ErrorFeedback(
            {dtype: torch.zeros_like(buf) for dtype, buf in self.inner.buffers.items()}, "A2SGD")
        self.errors = self.feedback.errors
        self._sizes = {dtype: [p.numel() for p in self.inner.params[::-1] if p.dtype == dtype]
                       for dtype in self.inner.buffers}
        self.bytes_last_step = 0  # data-parallel bytes all-reduced by the last wait()

    @property
    def started(self) -> bool:
        return self.inner.started

    def start_when_ready(self) -> None:
        """No overlap: the A2SGD step needs the whole gradient."""

    def start(self) -> None:
        self.inner.start()
        if self.exact is not None:
            self.exact.start()

    def wait(self) -> None:
        self.inner.wait()
        if self.exact is not None:
            self.exact.wait()
        scale = float(self.loss_scale())
        self.bytes_last_step = 0
        for dtype, buffer in self.inner.buffers.items():
            values = buffer.double() / scale + self.errors[dtype].double()
            bounds = segment_bounds(self._sizes[dtype], self.granularity, self.bucket_size)
            stats = local_statistics(values, bounds)
            if group_size(self.data_group) > 1:
                dist.all_reduce(stats, group=self.data_group)
            self.bytes_last_step += stats.numel() * stats.element_size()
            applied = two_level_values(values, stats, bounds)
            self.feedback.stage(dtype, (values - applied).to(buffer.dtype))
            buffer.copy_(applied * scale)

    def attach(self, optimizer) -> None:
        """Read the loss scale (the errors are kept unscaled) and, for ``synchronize()``, the
        optimizer state from the run's :class:`~megatron.core.optimizer.MegatronOptimizer`."""
        self.loss_scale = lambda: optimizer.loss_scale
        self._optimizer_state = optimizer.optimizer.state

    def after_step(self, ok: bool) -> None:
        self.finish_step(ok)

    def synchronize(self) -> None:
        """The exact replica average of the parameters and the optimizer state (collective)."""
        self.average_parameters(self._optimizer_state)

    def finish_step(self, update_successful: bool) -> None:
        """Commit the staged error when the optimizer stepped; drop it on an overflow step."""
        self.feedback.commit(update_successful)

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        if self.exact is not None:
            self.exact.zero_grad()

    def state_dict(self) -> dict:
        """The error buffers (per dtype, in this reducer's flat layout)."""
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state)

    def average_parameters(self, optimizer_state: Optional[dict] = None) -> None:
        """Make the replicas identical: the exact mean over the data-parallel group of every
        parameter and (given the torch optimizer's ``state``) of its optimizer state tensors."""
        size = group_size(self.data_group)
        if size == 1:
            return
        with torch.no_grad():
            for param in self.params:
                tensors = [param.data]
                if optimizer_state is not None:
                    tensors += [value for value in optimizer_state.get(param, {}).values()
                                if torch.is_tensor(value) and value.is_floating_point()]
                for tensor in tensors:
                    dist.all_reduce(tensor, group=self.data_group)
                    tensor.div_(size)


def build_a2sgd_reduction(request: ChunkReductionRequest) -> A2SGDReducer:
    """One chunk's A2SGD reduction: exact over the direction group (this replica's copies of the
    stage), two-level means over the data-parallel group; with tensor parallelism the
    tensor-parallel-replicated parameters are all-reduced exactly over the stage's replica group."""
    def exact(param):
        return request.tensor_parallel and not getattr(param, "tensor_model_parallel", False)
    interval = request.parallel.a2sgd_sync_interval if request.parallel is not None else 0
    return A2SGDReducer([p for p in request.params if not exact(p)],
                        direction_group=request.direction_group(),
                        data_group=request.data_group,
                        exact_params=[p for p in request.params if exact(p)],
                        exact_group=request.replica_group, dp_size=int(request.divide_by),
                        sync_interval=interval)


def check_a2sgd_flags(parallel) -> None:
    """The flag rules of ``--dp-gradient-reducer a2sgd``."""
    if parallel.a2sgd_sync_interval < 1:
        raise ValueError(f"--a2sgd-sync-interval must be >= 1 (got {parallel.a2sgd_sync_interval})")
    if parallel.use_distributed_optimizer:
        raise ValueError("--dp-gradient-reducer a2sgd and --use-distributed-optimizer both replace "
                         "the data-parallel gradient all-reduce; choose one")


A2SGD_REDUCER = ReducerKind(
    name="a2sgd", description="A2SGD: two means per worker with error feedback (docs/a2sgd.md)",
    build=build_a2sgd_reduction, needs_direction_groups=True,
    overlaps=False,  # the A2SGD step needs the whole gradient
    validate=check_a2sgd_flags)


def a2sgd_reducers(reducers: Iterable) -> list[A2SGDReducer]:
    """The A2SGD reducers among a rank's reducers (for measurements such as benchmarks/a2sgd.py)."""
    return [r for r in reducers if isinstance(r, A2SGDReducer)]
