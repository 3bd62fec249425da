"""A2SGD: two-level gradient averaging as the data-parallel reduction (O(1) numbers per worker).

A2SGD (Bhattacharya, Yu, Chowdhury; arXiv 2006.07405) replaces the data-parallel all-reduce of the
whole gradient by an all-reduce of four numbers per *segment* (the whole model portion a reducer
owns by default, as in the paper; or each bucket / each tensor). Per step, on data-parallel rank i:

1. ``p = g + e`` (``g`` this replica's gradient, ``e`` the error kept from the last step, both in
   loss-unscaled units);
2. the sum and count of the non-negative entries of ``p`` and of the negative entries, all-reduced
   over the data-parallel group: global means ``m+`` and ``m-``;
3. the applied gradient is ``m+`` where ``p >= 0`` and ``m-`` elsewhere; ``e <- p - applied``.

The new error is *staged* and committed by :func:`finish_a2sgd_step` only when the optimizer
stepped (a loss-scale overflow or a non-finite norm discards it). Replicas apply different updates
and drift, so :func:`average_replicas` averages the parameters exactly over the data-parallel group
(every ``--a2sgd-sync-interval`` steps and before every checkpoint and evaluation).

Exactness is kept where the issue asks: gradients of one replica's copies of a stage (Chimera's two
pipeline directions) are summed exactly over the *direction group* first (ranks of this data-parallel
replica holding the stage), then A2SGD runs over the data-parallel group (same pipeline rank, other
replicas); with tensor parallelism the tensor-parallel-replicated parameters (layer norms, biases of
row-parallel layers) are all-reduced exactly over the stage's full replica group, since their A2SGD
means would otherwise differ between tensor-parallel ranks. Tied embeddings keep their exact
:class:`~.reducers.TiedEmbeddingReducer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.gradient_reducer import GradientReducer

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


class A2SGDReducer:
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
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, direction_group: Any = None,
                 data_group: Any = None, exact_params: Iterable[torch.nn.Parameter] = (),
                 exact_group: Any = None, dp_size: int = 1, granularity: str = "model",
                 bucket_size: int = 1_000_000):
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
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.errors = {dtype: torch.zeros_like(buf) for dtype, buf in self.inner.buffers.items()}
        self._staged: Optional[dict] = None
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
        staged, self.bytes_last_step = {}, 0
        for dtype, buffer in self.inner.buffers.items():
            values = buffer.double() / scale + self.errors[dtype].double()
            bounds = segment_bounds(self._sizes[dtype], self.granularity, self.bucket_size)
            stats = local_statistics(values, bounds)
            if group_size(self.data_group) > 1:
                dist.all_reduce(stats, group=self.data_group)
            self.bytes_last_step += stats.numel() * stats.element_size()
            applied = two_level_values(values, stats, bounds)
            staged[dtype] = (values - applied).to(buffer.dtype)
            buffer.copy_(applied * scale)
        self._staged = staged

    def finish_step(self, update_successful: bool) -> None:
        """Commit the staged error when the optimizer stepped; drop it on an overflow step."""
        if self._staged is not None and update_successful:
            for dtype, error in self._staged.items():
                self.errors[dtype].copy_(error)
        self._staged = None

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        if self.exact is not None:
            self.exact.zero_grad()

    def state_dict(self) -> dict:
        """The error buffers (per dtype, in this reducer's flat layout)."""
        return {"errors": {str(dtype): error.clone() for dtype, error in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        for dtype, error in self.errors.items():
            saved = state["errors"][str(dtype)]
            if saved.shape != error.shape:
                raise ValueError(f"A2SGD error buffer of {saved.numel()} elements does not fit this "
                                 f"model chunk ({error.numel()}); load with the same model and "
                                 f"parallel layout, or without the optimizer state")
            error.copy_(saved)

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


@dataclass(frozen=True)
class A2SGDSetup:
    """How :func:`~.reducers.build_gradient_reducers` builds A2SGD reducers for a rank.

    ``direction_group_of(key)``: the group of this replica's copies of the chunk's stage (None for
    one-directional schedules); ``split_tensor_replicated``: with tensor parallelism, reduce the
    tensor-parallel-replicated parameters exactly.
    """

    data_group: Any = None
    direction_group_of: Callable[[Hashable], Any] = lambda key: None
    split_tensor_replicated: bool = False
    granularity: str = "model"

    def build(self, params: Sequence[torch.nn.Parameter], key: Hashable, replica_group: Any,
              dp_size: int) -> A2SGDReducer:
        def exact(param):
            return self.split_tensor_replicated and not getattr(param, "tensor_model_parallel",
                                                                False)
        return A2SGDReducer([p for p in params if not exact(p)],
                            direction_group=self.direction_group_of(key),
                            data_group=self.data_group,
                            exact_params=[p for p in params if exact(p)],
                            exact_group=replica_group, dp_size=dp_size,
                            granularity=self.granularity)


def a2sgd_reducers(reducers: Iterable) -> list[A2SGDReducer]:
    return [r for r in reducers if isinstance(r, A2SGDReducer)]


def attach_loss_scale(reducers: Iterable, loss_scale: Callable[[], float]) -> None:
    """Tell the A2SGD reducers the current loss scale (their errors are kept unscaled)."""
    for reducer in a2sgd_reducers(reducers):
        reducer.loss_scale = loss_scale


def finish_a2sgd_step(reducers: Iterable, update_successful: bool) -> None:
    for reducer in a2sgd_reducers(reducers):
        reducer.finish_step(update_successful)


def average_replicas(reducers: Iterable, optimizer_state: Optional[dict] = None) -> None:
    """The exact parameter (and optimizer-state) average of every A2SGD reducer (collective; the
    same order on every rank)."""
    for reducer in a2sgd_reducers(reducers):
        reducer.average_parameters(optimizer_state)


def synchronize_replicas(components) -> None:
    """The training loop's hook: average a run's A2SGD replicas (no-op with all-reduce)."""
    average_replicas(components.gradient_reducers, components.optimizer.optimizer.state)


def sync_due(iteration: int, interval: int) -> bool:
    return interval > 0 and iteration % interval == 0


def reducer_state(reducers: Iterable) -> Optional[list]:
    """The A2SGD error buffers of this rank, or None without A2SGD (for checkpoints)."""
    found = a2sgd_reducers(reducers)
    return [reducer.state_dict() for reducer in found] if found else None


def load_reducer_state(reducers: Iterable, states: Optional[list], dp_rank: int) -> None:
    """Restore this data-parallel rank's error buffers from a checkpoint's per-rank list."""
    found = a2sgd_reducers(reducers)
    if not found or not states:
        return
    if len(states) <= dp_rank or states[dp_rank] is None:
        raise ValueError("the checkpoint holds no A2SGD error buffers for data-parallel rank "
                         f"{dp_rank}; resume with the data-parallel size it was saved with")
    for reducer, state in zip(found, states[dp_rank], strict=True):
        reducer.load_state_dict(state)
