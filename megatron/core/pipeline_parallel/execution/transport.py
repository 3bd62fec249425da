"""Point-to-point transport between pipeline ranks: the seam, and its two implementations.

The lowering (:mod:`megatron.core.pipeline_parallel.planning.lowering`) groups every send and receive
a rank issues at one communication point so that both sides of each message are in matching groups;
a transport executes one such group. :class:`Transport` is the seam the interpreter uses:

* ``start(sends, receives)`` posts the whole group without blocking and returns a
  :class:`PendingExchange`, whose ``wait_received()`` completes the receives (and returns the
  tensors in the order of ``receives``) and ``wait_sent()`` completes the sends (after which the
  sent buffers may be reused);
* ``exchange(sends, receives)`` is ``start`` followed by both waits.

:class:`TensorTransport` sends one message per tensor; :class:`PackedTransport` packs every tensor
bound for one peer into one contiguous message (C++ extension or its Python twin,
:mod:`~megatron.core.pipeline_parallel.execution.packing`) and the receiver checks the header against
what the schedule says it should get. :func:`make_transport` picks one from the packer.

Shapes and dtypes of received tensors are known in advance (the stage contract declares them), so
receive buffers are allocated before the data arrives.

Posting is on the critical path of every pipeline hop (the sender posts right after its compute op,
the receiver unpacks right before its own), so the per-message work is kept to what the message
needs: peers' global ranks and packed sizes are computed once per transport, on a backend that does
not coalesce point-to-point ops (gloo) the messages are posted on the process group itself
(``group.send`` / ``group.recv`` with the peer's group rank, resolved once: what ``isend`` /
``irecv`` and ``batch_isend_irecv`` end in there, without their per-call checks and ``P2POp``
bookkeeping), and the
receiver's header check compares the layout directly, building its error text only on a mismatch
(docs/benchmarks.md §9, "Where a hop's time goes"). On each directed link the send order equals
the receive order, so an in-order channel (NCCL ignores tags) cannot mix messages up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.timeouts import describe_group, named_timeout


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
    """What crossed the wire (for the packing benchmark and the log); ``seconds`` is the time the
    rank spent posting messages and blocked waiting for them (not the time they were in flight)."""

    messages: int = 0
    bytes: int = 0
    exchanges: int = 0
    seconds: float = 0.0


class PendingExchange(Protocol):
    """A posted communication group."""

    def wait_received(self) -> list[torch.Tensor]:
        """Complete the receives; the received tensors in the order they were asked for."""

    def wait_sent(self) -> None:
        """Complete the sends (their buffers may be reused afterwards)."""


class Transport(Protocol):
    """What the interpreter needs to move activations and gradients between pipeline ranks."""

    stats: TransportStats

    def start(self, sends: Sequence[OutgoingTensor],
              receives: Sequence[ExpectedTensor]) -> PendingExchange:
        """Post one communication group without blocking."""

    def exchange(self, sends: Sequence[OutgoingTensor],
                 receives: Sequence[ExpectedTensor]) -> list[torch.Tensor]:
        """Post one group and complete it; the received tensors in the order of ``receives``."""

    def sends_complete_in_background(self) -> bool:
        """Whether the plan may post every send right after its producer (eager sends)."""


@dataclass
class _Posted:
    """The requests of one posted group and how to turn its receive buffers into tensors."""

    send_requests: list
    receive_requests: list
    finish: Callable[[], list]
    stats: TransportStats
    outgoing: list  # the sent buffers, alive until the sends complete
    describe: Callable[[str], str]  # "receive" / "send" -> what is awaited, for timeout errors

    def wait_received(self) -> list[torch.Tensor]:
        started = time.perf_counter()
        _wait_all(self.receive_requests, lambda: self.describe("receive"))
        self.receive_requests = []
        received = self.finish()
        self.stats.seconds += time.perf_counter() - started
        return received

    def wait_sent(self) -> None:
        started = time.perf_counter()
        _wait_all(self.send_requests, lambda: self.describe("send"))
        self.send_requests = []
        self.outgoing = []
        self.stats.seconds += time.perf_counter() - started


def _wait_all(requests: list, what: Callable[[], str]) -> None:
    """Wait for every request; a backend timeout is re-raised as a
    :class:`~megatron.core.distributed.timeouts.CommunicationTimeout` naming ``what()``
    (:func:`named_timeout`: a plain call, no generator context manager on the hop's path)."""
    try:
        for request in requests:
            request.wait()
    except RuntimeError as error:
        named = named_timeout(error, what)
        if named is None:
            raise
        raise named from error


class _Message(NamedTuple):
    """One send or receive to post: ``operation`` is ``dist.isend`` or ``dist.irecv``, ``peer``
    the global rank on ``group`` (a tuple: built for every message, on the hop's critical path)."""

    operation: Callable
    tensor: torch.Tensor
    peer: int
    group: Any


def _by_peer(items: Sequence) -> dict:
    """{peer: [items bound for / expected from it]}, peers in first-seen order, items in order."""
    groups: dict = {}
    for item in items:
        same_peer = groups.get(item.peer)
        if same_peer is None:
            groups[item.peer] = [item]
        else:
            same_peer.append(item)
    return groups


@dataclass
class _PeerTransport:
    """Shared part: pipeline peer -> global rank, posting a list of P2P ops, statistics."""

    parallel_state: Any
    device: torch.device
    stats: TransportStats = field(default_factory=TransportStats)
    # pipeline rank -> global rank; the layout never changes during a run
    _global_ranks: dict = field(default_factory=dict, repr=False, compare=False)
    # global rank -> its rank in the pipeline group (for posting on the group directly)
    _group_ranks: dict = field(default_factory=dict, repr=False, compare=False)
    _one_by_one: Optional[bool] = field(default=None, repr=False, compare=False)

    def start(self, sends: Sequence[OutgoingTensor],
              receives: Sequence[ExpectedTensor]) -> PendingExchange:
        """Post ``sends`` and ``receives`` as one exchange (each subclass packs them its way)."""
        raise NotImplementedError

    def global_rank(self, pipeline_rank: int) -> int:
        known = self._global_ranks.get(pipeline_rank)
        if known is None:
            coords = self.parallel_state.coords
            known = self.parallel_state.layout.rank(type(coords)(coords.tp, coords.dp,
                                                                 pipeline_rank))
            self._global_ranks[pipeline_rank] = known
        return known

    def p2p_op(self, operation, tensor: torch.Tensor, pipeline_rank: int) -> "_Message":
        """A send (``operation`` = ``dist.isend``) or receive (``dist.irecv``) with pipeline rank
        ``pipeline_rank`` on this rank's pipeline group (its own communicator: another job's or
        another group's messages never mix with it); posted by :meth:`_post`."""
        return _Message(operation, tensor, self.global_rank(pipeline_rank),
                        self.parallel_state.pipeline_group)

    def _posts_one_by_one(self) -> bool:
        """Whether the pipeline group's backend does not coalesce point-to-point ops (gloo):
        ``batch_isend_irecv`` then posts them one by one with ``isend``/``irecv``, so the
        transport does that itself, without building ``P2POp`` lists. A coalescing backend (NCCL)
        keeps ``batch_isend_irecv``: it may run a batch on another communicator than single ops."""
        if self._one_by_one is None:
            group = self.parallel_state.pipeline_group
            try:
                coalesces = group._get_backend(self.device).supports_coalescing
            except (AttributeError, RuntimeError):  # unknown group object: keep the batch path
                coalesces = True
            self._one_by_one = type(group) is dist.ProcessGroup and not coalesces
        return self._one_by_one

    def sends_complete_in_background(self) -> bool:
        """Whether a posted send completes without this rank's help and never holds up its
        later posts: on gloo every message is posted on its own and gloo's threads finish it, so
        a plan may post each send right after its producer (eager sends, deadlock-free under the
        simulator's asynchronous semantics). A coalescing backend (NCCL) orders point-to-point
        work on a stream, which was not checked with eager sends: False there."""
        return self._posts_one_by_one()

    def _post_on_group(self, message: "_Message"):
        """Post one send or receive on the pipeline group itself (gloo, see
        :meth:`_posts_one_by_one`): what ``dist.isend`` / ``dist.irecv`` call after their checks
        (a real tensor, this rank in the group, the peer's group rank), which hold for every
        message of a pipeline group and are made once per peer here."""
        if message.tensor.is_complex():  # the wrappers send such a tensor as its real view
            return message.operation(message.tensor, message.peer, group=message.group)
        group_rank = self._group_ranks.get(message.peer)
        if group_rank is None:
            group_rank = self._group_ranks[message.peer] = dist.get_group_rank(message.group,
                                                                               message.peer)
        if message.operation is dist.isend:
            return message.group.send([message.tensor], group_rank, 0)
        return message.group.recv([message.tensor], group_rank, 0)

    def describe_wait(self, direction: str, items: Sequence) -> str:
        """What a wait on ``items`` (OutgoingTensor or ExpectedTensor) is for, naming the peers and
        the pipeline group; used only when the wait times out."""
        peers = list(dict.fromkeys(item.peer for item in items))
        whats = ", ".join(item.what for item in items)
        towards = "from" if direction == "receive" else "to"
        pipeline_ranks = ", ".join(f"{peer} (global rank {self.global_rank(peer)})"
                                   for peer in peers)
        return (f"the {direction} of {whats or 'nothing'} {towards} pipeline rank {pipeline_ranks} "
                f"on " + describe_group("pipeline", self.parallel_state.pipeline_group,
                                        [self.global_rank(peer) for peer in peers]))

    def _post(self, sends: list, receives: list, finish: Callable[[], list],
              items: tuple[Sequence, Sequence]) -> _Posted:
        """Issue ``sends`` then ``receives`` (:class:`_Message` lists) as one batch; ``items`` are
        the (OutgoingTensor, ExpectedTensor) lists they carry, named if a wait times out."""
        posting = time.perf_counter()
        stats = self.stats
        stats.exchanges += 1
        stats.messages += len(sends)
        for op in sends:
            stats.bytes += op.tensor.nbytes
        messages = sends + receives
        if not messages:
            requests = []
        elif self._posts_one_by_one():
            requests = [self._post_on_group(m) for m in messages]
        else:
            requests = dist.batch_isend_irecv(
                [dist.P2POp(m.operation, m.tensor, m.peer, group=m.group) for m in messages])
        if len(requests) == len(sends) + len(receives):
            send_requests, receive_requests = requests[:len(sends)], requests[len(sends):]
        else:  # a backend that coalesces the batch into fewer requests: wait for all of them
            send_requests, receive_requests = [], list(requests)
        self.stats.seconds += time.perf_counter() - posting
        outgoing_items, expected_items = items
        return _Posted(send_requests, receive_requests, finish, self.stats,
                       [op.tensor for op in sends],
                       lambda direction: self.describe_wait(
                           direction, outgoing_items if direction == "send" else expected_items))

    def exchange(self, sends: Sequence[OutgoingTensor],
                 receives: Sequence[ExpectedTensor]) -> list[torch.Tensor]:
        pending = self.start(sends, receives)
        received = pending.wait_received()
        pending.wait_sent()
        return received


class TensorTransport(_PeerTransport):
    """One message per tensor."""

    def describe(self) -> str:
        return "one message per tensor"

    def start(self, sends: Sequence[OutgoingTensor],
              receives: Sequence[ExpectedTensor]) -> PendingExchange:
        send_ops = [self.p2p_op(dist.isend, item.tensor.contiguous(), item.peer)
                    for item in sends]
        buffers = [torch.empty(item.shape, dtype=item.dtype, device=self.device)
                   for item in receives]
        receive_ops = [self.p2p_op(dist.irecv, buffer, item.peer)
                       for item, buffer in zip(receives, buffers)]
        return self._post(send_ops, receive_ops, lambda: buffers, (sends, receives))


@dataclass
class PackedTransport(_PeerTransport):
    """Every tensor bound for one peer in one packed message (see the module docstring)."""

    packer: Any = None
    # ((shape, dtype), ...) of one peer's tensors -> packed message size
    _packed_sizes: dict = field(default_factory=dict, repr=False, compare=False)

    def _packed_nbytes(self, specs: tuple) -> int:
        nbytes = self._packed_sizes.get(specs)
        if nbytes is None:
            nbytes = self._packed_sizes[specs] = self.packer.packed_nbytes(specs)
        return nbytes

    def start(self, sends: Sequence[OutgoingTensor],
              receives: Sequence[ExpectedTensor]) -> PendingExchange:
        send_ops = [self.p2p_op(dist.isend, self.packer.pack([item.tensor for item in items],
                                                             device=self.device), peer)
                    for peer, items in _by_peer(sends).items()]
        incoming = {}
        for peer, expected in _by_peer(receives).items():
            nbytes = self._packed_nbytes(tuple((tuple(item.shape), item.dtype)
                                               for item in expected))
            incoming[peer] = (torch.empty(nbytes, dtype=torch.uint8, device=self.device), expected)
        receive_ops = [self.p2p_op(dist.irecv, buffer, peer)
                       for peer, (buffer, _) in incoming.items()]
        return self._post(send_ops, receive_ops,
                          lambda: self._unpack_all(incoming, receives), (sends, receives))

    def _unpack_checked(self, peer: int, buffer: torch.Tensor, expected: list) -> list:
        """The tensors of one peer's message, after checking its header against ``expected``."""
        tensors = self.packer.unpack(buffer, device=self.device)
        agrees = len(tensors) == len(expected) and all(
            tensor.dtype == item.dtype and tuple(tensor.shape) == tuple(item.shape)
            for tensor, item in zip(tensors, expected))
        if not agrees:
            # the full check raises, naming the message and both layouts (its text is built
            # only when the header disagrees)
            self.packer.unpack(buffer, device=self.device,
                               expected=[(tuple(item.shape), item.dtype) for item in expected],
                               what=f"message from pipeline rank {peer} carrying "
                                    f"{', '.join(item.what for item in expected)}")
        return tensors

    def _unpack_all(self, incoming: dict, receives: Sequence[ExpectedTensor]) -> list:
        if len(incoming) == 1:  # one peer: its message holds every receive, in order
            ((peer, (buffer, expected)),) = incoming.items()
            return self._unpack_checked(peer, buffer, expected)
        received = {}
        for peer, (buffer, expected) in incoming.items():
            for item, tensor in zip(expected, self._unpack_checked(peer, buffer, expected)):
                received[id(item)] = tensor
        return [received[id(item)] for item in receives]


def make_transport(parallel_state, packer, device: torch.device) -> Transport:
    """The packed transport when ``packer.enabled``, else one message per tensor."""
    if getattr(packer, "enabled", False):
        return PackedTransport(parallel_state, device, packer=packer)
    return TensorTransport(parallel_state, device)
