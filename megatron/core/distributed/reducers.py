"""The tied-embedding reducer, the built-in reducer table and the one factory both runtimes use.

The seam itself (:class:`GradientReduction`, its lifecycle and declared attributes) is in
:mod:`megatron.core.distributed.reduction`; it is re-exported here.

:func:`build_gradient_reducers` is the one place that decides which parameters are reduced over
which group: one reduction per model chunk over the group of its stage's replicas (the
data-parallel group without a pipeline; every pipeline's copy of the stage times data parallel for
Chimera), built by the :class:`~.reduction.ReducerKind` that ``--dp-gradient-reducer`` names in the
runtime's :class:`~.reduction.ReducerTable` (:data:`BUILTIN_REDUCERS`: ``allreduce``, a
:class:`~.gradient_reducer.GradientReducer`, or with ``--use-distributed-optimizer`` a
:class:`~.sharded_reducer.ShardedGradientReducer`; ``a2sgd``, :mod:`~megatron.core.distributed.a2sgd`;
``topk`` and ``qsgd``, :mod:`~.topk` and :mod:`~.qsgd`),
plus, when the word embedding and a tied output layer live in different stages, a
:class:`TiedEmbeddingReducer` started after everything else. A new reducer is one
:class:`~.reduction.ReducerKind` added to a table (``BUILTIN_REDUCERS.with_kind(...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.a2sgd import A2SGD_REDUCER
from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.gradient_reducer import GradientReducer
from megatron.core.distributed.qsgd import QSGD_REDUCER
from megatron.core.distributed.reduction import (ChunkReductionRequest, GradientReduction,
                                                 ReducerKind, ReducerTable)
from megatron.core.distributed.sharded_reducer import ShardedGradientReducer
from megatron.core.distributed.timeouts import awaiting, describe_group
from megatron.core.distributed.topk import TOPK_REDUCER

__all__ = ["ALLREDUCE_REDUCER", "BUILTIN_REDUCERS", "GradientReduction", "ModelReducers",
           "TiedEmbeddingReducer", "build_gradient_reducers", "is_shared_embedding",
           "tied_copies"]


def build_exact_reduction(request: ChunkReductionRequest) -> GradientReduction:
    """``allreduce``: the exact all-reduce, or the reduce-scatter of the distributed optimizer."""
    reduce_dtype = grad_reduce_dtype(request.parallel)
    if request.sharded:
        key = request.key
        return ShardedGradientReducer(request.params, request.replica_group,
                                      divide_by=request.divide_by,
                                      stage_id=getattr(key, "stage", key),  # (pipeline, stage) key
                                      reduce_dtype=reduce_dtype)
    return GradientReducer(request.params, request.replica_group, divide_by=request.divide_by,
                           bucket_size=request.bucket_size, overlap=request.overlap,
                           reduce_dtype=reduce_dtype)


def grad_reduce_dtype(parallel_config: Any) -> Optional[torch.dtype]:
    """The dtype of the data-parallel collectives: bfloat16 with ``--grad-reduce-in-bf16`` (its
    validation keeps it only with ``--bf16``), else None (the gradients' own dtype)."""
    if getattr(parallel_config, "grad_reduce_in_bf16", False):
        return torch.bfloat16
    return None


ALLREDUCE_REDUCER = ReducerKind(
    name="allreduce", description="exact all-reduce over each stage's replicas",
    build=build_exact_reduction)

# The kinds --dp-gradient-reducer chooses from (its choices in megatron/core/config.py).
BUILTIN_REDUCERS = ReducerTable((ALLREDUCE_REDUCER, A2SGD_REDUCER,
                                 TOPK_REDUCER,  # megatron/core/distributed/topk.py
                                 QSGD_REDUCER))  # megatron/core/distributed/qsgd.py


def is_shared_embedding(param: torch.nn.Parameter) -> bool:
    """The word embedding when the output layer reuses it (marked by the model)."""
    return bool(getattr(param, "shared_embedding", False))


def tied_copies(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The copies of the tied embedding weight in this rank's chunks (empty when untied)."""
    return [p for chunk in chunks for p in chunk.parameters() if is_shared_embedding(p)]


class TiedEmbeddingReducer(GradientReduction):
    """Keeps the tied word-embedding copies identical: local sum, all-reduce, write back."""

    def __init__(self, copies: Sequence[torch.nn.Parameter], group, divide_by: float,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.copies = list(copies)
        self.reduce_dtype = reduce_dtype  # --grad-reduce-in-bf16: the all-reduce's dtype
        self.group = group
        self.divide_by = float(divide_by)
        self._total = None
        self._handle = None

    @property
    def started(self) -> bool:
        return self._total is not None

    def start_when_ready(self) -> None:
        """Started explicitly, after every chunk's reduction."""

    def start(self) -> None:
        grads = [p.grad for p in self.copies if p.grad is not None]
        if not grads:
            # A copy may have no gradient yet (e.g. forward-only); treat it as zero.
            grads = [torch.zeros_like(self.copies[0])]
        total = torch.stack(grads).sum(0) / self.divide_by
        if group_size(self.group) > 1:
            if self.reduce_dtype is not None:
                total = total.to(self.reduce_dtype)  # cast back to the gradients' in wait()
            self._handle = dist.all_reduce(total, group=self.group, async_op=True)
        self._total = total

    def wait(self) -> None:
        if self._total is None:
            self.start()
        if self._handle is not None:
            with awaiting(lambda: "the tied-embedding gradient all-reduce on "
                          + describe_group("tied-embedding", self.group)):
                self._handle.wait()
            self._handle = None
        for param in self.copies:
            if param.grad is None:
                param.grad = self._total.to(param.dtype, copy=True)
            else:
                param.grad.copy_(self._total)
        self._total = None

    def zero_grad(self) -> None:
        for param in self.copies:
            if param.grad is not None:
                param.grad.zero_()


@dataclass
class ModelReducers:
    """A rank's gradient reductions: one per model chunk (by module key) and the final ones.

    ``final`` (the tied embedding) starts once every chunk's reduction has been started.
    """

    by_module: dict = field(default_factory=dict)
    final: list = field(default_factory=list)

    @property
    def all(self) -> list:
        return list(self.by_module.values()) + list(self.final)


def build_gradient_reducers(chunks: Sequence[torch.nn.Module], keys: Sequence[Hashable],
                            group_of: Callable[[Hashable], Any], divide_by: float, *,
                            tied_group: Optional[Callable[[], Any]] = None,
                            bucket_size: Optional[int] = None,
                            overlap: bool = False, sharded: bool = False,
                            kind: ReducerKind = ALLREDUCE_REDUCER, parallel: Any = None,
                            data_group: Any = None,
                            direction_group_of: Callable[[Hashable], Any] = lambda key: None,
                            tensor_parallel: bool = False) -> ModelReducers:
    """Reductions for a rank's ``chunks`` (see the module docstring).

    Args:
        keys: one key per chunk (its (pipeline, stage) module key).
        group_of: ``group_of(key)`` -> the process group over that chunk's replicas.
        divide_by: the data-parallel size (gradients are averaged over data parallel).
        tied_group: ``tied_group()`` -> the group over every rank holding a tied-embedding copy,
            or None when the embedding and the output layer are not split across stages (then
            the shared weight is reduced with its chunk like any other parameter).
        bucket_size, overlap: as for :class:`GradientReducer` (``--overlap-grad-reduce``; the
            overlap is dropped unless the kind ``overlaps``).
        sharded: ``--use-distributed-optimizer`` (the ``allreduce`` kind then reduce-scatters).
        kind: the :class:`~.reduction.ReducerKind` (``--dp-gradient-reducer``) building each chunk's
            reduction; ``parallel``, ``data_group``, ``direction_group_of(key)`` and
            ``tensor_parallel`` are handed to it in the :class:`~.reduction.ChunkReductionRequest`.
    """
    split_tied = tied_group is not None
    overlap = overlap and kind.overlaps
    reducers = ModelReducers()
    for chunk, key in zip(chunks, keys):
        params = [p for p in chunk.parameters()
                  if p.requires_grad and not (split_tied and is_shared_embedding(p))]
        request = ChunkReductionRequest(
            params=params, key=key, replica_group=group_of(key), divide_by=divide_by,
            data_group=data_group, direction_group=lambda key=key: direction_group_of(key),
            tensor_parallel=tensor_parallel, parallel=parallel, sharded=sharded,
            bucket_size=bucket_size, overlap=overlap)
        reducers.by_module[key] = kind.build(request)
    copies = tied_copies(chunks) if split_tied else []
    if copies:
        reducers.final.append(TiedEmbeddingReducer(copies, tied_group(), divide_by=divide_by,
                                                   reduce_dtype=grad_reduce_dtype(parallel)))
    return reducers
