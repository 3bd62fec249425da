"""The gradient-reduction seam, the tied-embedding reducer and the one factory both runtimes use.

A *gradient reduction* (:class:`GradientReduction`) owns the gradients of some parameters and makes
them equal to the sum (divided by ``divide_by``) over the ranks of one process group:

* ``start()`` launches the reduction without blocking (the schedule decides when);
* ``start_when_ready()`` optionally arms a launch from inside the next backward (overlap);
* ``wait()`` completes it (starting it first if nobody did); ``started`` says whether it is in flight;
* ``zero_grad()`` clears the gradients for the next iteration.

:func:`build_gradient_reducers` is the one place that decides which parameters are reduced over
which group: one :class:`~.gradient_reducer.GradientReducer` per model chunk over the group of its
stage's replicas (the data-parallel group without a pipeline; every pipeline's copy of the stage
times data parallel for Chimera), plus, when the word embedding and a tied output layer live in
different stages, a :class:`TiedEmbeddingReducer` started after everything else. Alternative
reducers (a distributed optimizer's reduce-scatter, compressed data-parallel reducers) plug in
here by implementing :class:`GradientReduction` (the distributed optimizer's
:class:`~.sharded_reducer.ShardedGradientReducer` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.a2sgd import A2SGDSetup
from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.gradient_reducer import GradientReducer
from megatron.core.distributed.sharded_reducer import ShardedGradientReducer
from megatron.core.distributed.timeouts import awaiting, describe_group


class GradientReduction(Protocol):
    """The seam: what the runtimes and the optimizer need from a gradient reduction."""

    @property
    def started(self) -> bool: ...

    def start_when_ready(self) -> None: ...

    def start(self) -> None: ...

    def wait(self) -> None: ...

    def zero_grad(self) -> None: ...


def is_shared_embedding(param: torch.nn.Parameter) -> bool:
    """The word embedding when the output layer reuses it (marked by the model)."""
    return bool(getattr(param, "shared_embedding", False))


def tied_copies(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The copies of the tied embedding weight in this rank's chunks (empty when untied)."""
    return [p for chunk in chunks for p in chunk.parameters() if is_shared_embedding(p)]


class TiedEmbeddingReducer:
    """Keeps the tied word-embedding copies identical: local sum, all-reduce, write back."""

    def __init__(self, copies: Sequence[torch.nn.Parameter], group, divide_by: float):
        self.copies = list(copies)
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
                param.grad = self._total.clone()
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
                            a2sgd: Optional[A2SGDSetup] = None) -> ModelReducers:
    """Reductions for a rank's ``chunks`` (see the module docstring).

    Args:
        keys: one key per chunk (its (pipeline, stage) module key).
        group_of: ``group_of(key)`` -> the process group over that chunk's replicas.
        divide_by: the data-parallel size (gradients are averaged over data parallel).
        tied_group: ``tied_group()`` -> the group over every rank holding a tied-embedding copy,
            or None when the embedding and the output layer are not split across stages (then
            the shared weight is reduced with its chunk like any other parameter).
        bucket_size, overlap: as for :class:`GradientReducer` (``--overlap-grad-reduce``).
        sharded: reduce-scatter each chunk's gradients for the distributed optimizer
            (:class:`~.sharded_reducer.ShardedGradientReducer`) instead of all-reducing them.
        a2sgd: when given (``--dp-gradient-reducer a2sgd``), each chunk's data-parallel reduction
            is an :class:`~.a2sgd.A2SGDReducer` (see :mod:`megatron.core.distributed.a2sgd`).
    """
    split_tied = tied_group is not None
    reducers = ModelReducers()
    for chunk, key in zip(chunks, keys):
        params = [p for p in chunk.parameters()
                  if p.requires_grad and not (split_tied and is_shared_embedding(p))]
        if a2sgd is not None:
            reducers.by_module[key] = a2sgd.build(params, key, group_of(key), int(divide_by))
        elif sharded:
            reducers.by_module[key] = ShardedGradientReducer(
                params, group_of(key), divide_by=divide_by,
                stage_id=getattr(key, "stage", key))  # a (pipeline, stage) key, or a number
        else:
            reducers.by_module[key] = GradientReducer(params, group_of(key), divide_by=divide_by,
                                                      bucket_size=bucket_size, overlap=overlap)
    copies = tied_copies(chunks) if split_tied else []
    if copies:
        reducers.final.append(TiedEmbeddingReducer(copies, tied_group(), divide_by=divide_by))
    return reducers
