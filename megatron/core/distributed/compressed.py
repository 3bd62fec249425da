"""The common frame of the compressing data-parallel reducers (top-k, QSGD): exact inside a replica,
compressed between replicas, the same averaged gradient on every replica.

A compressing reducer owns one model chunk's gradients like an all-reduce does, but between
data-parallel replicas it exchanges a compressed form of each replica's gradient: every rank
compresses its (loss-unscaled) gradient into a *payload*, the payloads of the data-parallel group
are all-gathered, and every rank decompresses and sums them in rank order and divides by the
data-parallel size. Every replica therefore applies the bitwise-same gradient, so unlike A2SGD the
replicas never drift and no periodic synchronisation is needed (``sync_interval`` 0).

What stays exact, as for A2SGD (:mod:`~.a2sgd`): the gradients of one replica's copies of a stage
(Chimera's two pipeline directions) are summed exactly over the *direction group* first, so both
copies compress the same numbers; with tensor parallelism the tensor-parallel-replicated
parameters are all-reduced exactly over the stage's replica group; tied embeddings keep their
:class:`~.reducers.TiedEmbeddingReducer`.

A subclass implements :meth:`CompressingReducer.compressed_average` (one dtype's flat gradient ->
the applied average) and, when it keeps state (error feedback, a random stream),
``commit(ok)``, ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import group_size
from megatron.core.distributed.gradient_reducer import ExactReductionsFirst
from megatron.core.distributed.reduction import ChunkReductionRequest
from megatron.core.distributed.timeouts import awaiting, describe_group


def all_gather_payloads(payload: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every data-parallel rank's ``payload`` (same shape and dtype on every rank), in rank order;
    just ``[payload]`` without a group."""
    size = group_size(group)
    if size == 1:
        return [payload]
    gathered = [torch.empty_like(payload) for _ in range(size)]
    with awaiting(lambda: "the compressed-gradient all-gather on "
                  + describe_group("data-parallel", group)):
        dist.all_gather(gathered, payload, group=group)
    return gathered


def ring_bytes_sent(payload_bytes: int, ranks: int, collective: str) -> float:
    """Bytes one rank sends in a ring algorithm: ``all_reduce`` of ``payload_bytes`` moves
    2 (P - 1) / P of it; ``all_gather`` of a ``payload_bytes`` contribution moves (P - 1) times
    it."""
    if ranks <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (ranks - 1) / ranks * payload_bytes
    if collective == "all_gather":
        return float((ranks - 1) * payload_bytes)
    raise ValueError(f"unknown collective {collective!r}; use all_reduce or all_gather")


class CompressingReducer(ExactReductionsFirst):
    """The frame (see the module docstring); subclasses compress.

    Args:
        params: the chunk's parameters whose gradients are compressed.
        direction_group: group of this replica's copies of the stage (None without several
            pipeline directions): gradients are summed exactly over it first.
        data_group: the data-parallel group the payloads are all-gathered over.
        exact_params, exact_group: parameters all-reduced exactly over ``exact_group`` (the
            tensor-parallel-replicated ones), divided by ``dp_size``.
        dp_size: the data-parallel size (the sum of the decompressed payloads is divided by it).
    """

    has_state = True

    def __init__(self, params: Iterable[torch.nn.Parameter], *, direction_group: Any = None,
                 data_group: Any = None, exact_params: Iterable[torch.nn.Parameter] = (),
                 exact_group: Any = None, dp_size: int = 1):
        self._reduce_exactly_first(params, direction_group, exact_params, exact_group, dp_size)
        self.data_group = data_group
        self.dp_size = int(dp_size)
        self.loss_scale: Callable[[], float] = lambda: 1.0
        self.payload_bytes_last_step = 0  # what this rank contributed to the all-gathers
        self._scratch: dict = {}  # (name, dtype) -> work buffer kept between steps

    # ------------------------------------------------------------------ what a subclass provides

    def compressed_average(self, dtype: torch.dtype, values: torch.Tensor) -> torch.Tensor:
        """float32 ``values`` (this rank's unscaled gradient of one dtype; read only, it may be the
        gradient buffer itself) -> the applied gradient (float32, the same on every data-parallel
        rank; it may be a :meth:`scratch` buffer); adds to ``payload_bytes_last_step``."""
        raise NotImplementedError

    def commit(self, ok: bool) -> None:
        """After the optimizer step: keep what the last :meth:`wait` staged only if ``ok``."""

    # ------------------------------------------------------------------------- the seam

    def start_when_ready(self) -> None:
        """No overlap: compression needs the whole gradient."""

    def wait(self) -> None:
        self.wait_exact()
        scale = float(self.loss_scale())
        self.payload_bytes_last_step = 0
        for dtype, buffer in self.inner.buffers.items():
            unscaled = (buffer if scale == 1.0 and buffer.dtype == torch.float32
                        else buffer.float() / scale)
            applied = self.compressed_average(dtype, unscaled)
            buffer.copy_(applied)
            if scale != 1.0:
                buffer.mul_(scale)

    def scratch(self, name: str, dtype: torch.dtype, numel: int,
                element: torch.dtype = torch.float32) -> torch.Tensor:
        """A work buffer of ``numel`` ``element`` entries kept between steps (one per ``name`` and
        gradient dtype): allocating tens of megabytes afresh every step costs about as much as
        the arithmetic on them."""
        key = (name, dtype)
        if key not in self._scratch or self._scratch[key].numel() != numel:
            self._scratch[key] = torch.empty(numel, dtype=element)
        return self._scratch[key]

    def attach(self, optimizer) -> None:
        """Read the loss scale (the compression works in loss-unscaled units)."""
        self.loss_scale = lambda: optimizer.loss_scale

    def after_step(self, ok: bool) -> None:
        self.commit(ok)


def split_exact_params(request: ChunkReductionRequest) -> tuple[list, list]:
    """(compressed, exact) parameters of a chunk: with tensor parallelism the
    tensor-parallel-replicated parameters are reduced exactly (their compressed averages would
    otherwise differ between tensor-parallel ranks)."""
    def exact(param):
        return request.tensor_parallel and not getattr(param, "tensor_model_parallel", False)
    return ([p for p in request.params if not exact(p)], [p for p in request.params if exact(p)])


def refuse_distributed_optimizer(parallel, name: str) -> None:
    if parallel.use_distributed_optimizer:
        raise ValueError(f"--dp-gradient-reducer {name} and --use-distributed-optimizer both "
                         f"replace the data-parallel gradient all-reduce; choose one")
