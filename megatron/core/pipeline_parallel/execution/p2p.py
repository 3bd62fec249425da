"""Point-to-point transport between pipeline ranks: one batched exchange per communication group.

The lowering (:mod:`megatron.core.pipeline_parallel.planning.lowering`) groups every send and receive a rank
issues at one communication point so that both sides of each message are in matching groups; this
module executes one such group as a single ``torch.distributed.batch_isend_irecv`` and waits for it.

Shapes and dtypes of received tensors are known from the config (activations and their gradients are
``[seq, micro-batch, hidden]``), so receive buffers are allocated before the data arrives. With packing
on, every tensor bound for the same peer is packed into one contiguous message (C++ extension or its
Python twin, :mod:`megatron.core.pipeline_parallel.execution.packing`); the receiver checks the header against
what the schedule says it should get, and a mismatch names the instructions involved. On each
directed link the send order equals the receive order, so an in-order channel (NCCL ignores tags)
cannot mix messages up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class OutgoingTensor:
    """A tensor to send: to pipeline rank ``peer``; ``what`` names it in error messages."""

    peer: int
    tensor: torch.Tensor
    what: str


@dataclass(frozen=True)
class ExpectedTensor:
    """A tensor to receive from pipeline rank ``peer``, with its shape and dtype."""

    peer: int
    shape: tuple
    dtype: torch.dtype
    what: str


@dataclass
class TransportStats:
    """What crossed the wire (for the packing benchmark and the log)."""

    messages: int = 0
    bytes: int = 0
    exchanges: int = 0
    seconds: float = 0.0


@dataclass
class P2PTransport:
    """Executes communication groups for one rank over ``torch.distributed``.

    Args:
        parallel_state: gives the global rank of a pipeline peer (same TP and DP coordinates).
        packer: a :class:`~megatron.core.pipeline_parallel.execution.packing.Packer`; ``packer.enabled``
            False sends one message per tensor.
        device: where receive buffers live.
    """

    parallel_state: object
    packer: object
    device: torch.device
    stats: TransportStats = field(default_factory=TransportStats)

    def global_rank(self, pipeline_rank: int) -> int:
        coords = self.parallel_state.coords
        return self.parallel_state.layout.rank(type(coords)(coords.tp, coords.dp, pipeline_rank))

    def exchange(self, sends: Sequence[OutgoingTensor],
                 receives: Sequence[ExpectedTensor]) -> list[torch.Tensor]:
        """Send ``sends`` and receive ``receives`` in one batch; returns the received tensors in
        the order of ``receives``."""
        start = time.perf_counter()
        if getattr(self.packer, "enabled", False):
            received = self._exchange_packed(sends, receives)
        else:
            received = self._exchange_tensors(sends, receives)
        self.stats.exchanges += 1
        self.stats.seconds += time.perf_counter() - start
        return received

    def _run(self, ops: list) -> None:
        if not ops:
            return
        self.stats.messages += sum(1 for op in ops if op.op is dist.isend)
        self.stats.bytes += sum(op.tensor.numel() * op.tensor.element_size()
                                for op in ops if op.op is dist.isend)
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def _exchange_tensors(self, sends, receives) -> list[torch.Tensor]:
        ops, buffers = [], []
        for item in sends:
            ops.append(dist.P2POp(dist.isend, item.tensor.contiguous(),
                                  self.global_rank(item.peer)))
        for item in receives:
            buffer = torch.empty(item.shape, dtype=item.dtype, device=self.device)
            buffers.append(buffer)
            ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(item.peer)))
        self._run(ops)
        return buffers

    def _exchange_packed(self, sends, receives) -> list[torch.Tensor]:
        ops = []
        for peer in dict.fromkeys(item.peer for item in sends):
            tensors = [item.tensor for item in sends if item.peer == peer]
            ops.append(dist.P2POp(dist.isend, self.packer.pack(tensors, device=self.device),
                                  self.global_rank(peer)))
        incoming = {}
        for peer in dict.fromkeys(item.peer for item in receives):
            expected = [item for item in receives if item.peer == peer]
            nbytes = self.packer.packed_nbytes([(item.shape, item.dtype) for item in expected])
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            incoming[peer] = (buffer, expected)
            ops.append(dist.P2POp(dist.irecv, buffer, self.global_rank(peer)))
        self._run(ops)
        received = {}
        for peer, (buffer, expected) in incoming.items():
            what = (f"message from pipeline rank {peer} carrying "
                    f"{', '.join(item.what for item in expected)}")
            tensors = self.packer.unpack(buffer, device=self.device,
                                         expected=[(item.shape, item.dtype) for item in expected],
                                         what=what)
            for item, tensor in zip(expected, tensors):
                received[id(item)] = tensor
        return [received[id(item)] for item in receives]
