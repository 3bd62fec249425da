"""Lowering: add point-to-point communication and gradient synchronisation to a schedule.

Input: a validated schedule (per-rank :class:`Instruction` lists) and its ``ScheduleLayout``.
Output: per rank, a list of *lowered ops*, which is exactly what the runtime interpreter runs:

* :class:`~megatron.core.pipeline_parallel.planning.instructions.Instruction` -- a compute step (forward
  or backward of one micro-batch through the rank's model chunk ``instruction.chunk``). A
  forward of stage 0 reads its micro-batch from the data; a forward of the last stage computes
  the loss; a backward of the last stage starts from that loss. Nothing is communicated for them.
* :class:`P2PGroup` -- a tuple of :class:`P2POp` (send or receive of one :class:`Message` to or
  from a peer pipeline rank) to be issued together as ONE ``batch_isend_irecv`` and waited on
  before the next op. Never empty.
* :class:`GradSyncStart` -- start (non-blocking) the gradient reduction of the module
  (pipeline, stage): the data-parallel reduction and, for Chimera, the all-reduce over all
  replicas of that stage (every pipeline's copy of stage ``stage``).
* :class:`GradSyncWait` -- wait for every gradient reduction this rank started; always the
  last op. The optimizer step follows the list.

How groups are formed (chimera.md §6, generalised). The pass first computes a reference
timeline: every rank runs its list in order, each op as soon as its inputs exist, with planning
costs (forward 1, backward 2 by default; for the Chimera basic unit with equal costs this is the
slot rule). Each message gets the *round* T = start time of the op that consumes it. The sender
issues it at the last point in its list where all its ops ending by T are done, the receiver
just before its first op starting at or after T. All messages of one round that a rank sends or
receives at one point form one group; a point can hold several groups, one per round, in round
order. Hence on every link both sides have identical groups message for message, so packing the
tensors bound for one peer into one message per group is safe. With ``eager_sends`` (plans made
for a message latency δ > 0) a sender issues each message right after its producer instead,
never later than the rule above and never before a message of an earlier round to the same peer
(all messages of one round to one peer at the latest of their producers), so link order and
group matching hold and a message gets the whole slack of its round to travel. No rank can
block forever:
every op before a round-T group starts before T and only needs messages of earlier rounds, so
by induction over rounds every group is eventually posted by both sides. Within a group, ops
are sorted by (peer, send before receive, message kind, pipeline, stage, micro-batch); on
every directed link the send order therefore equals the receive order.

Gradient synchronisation policies (chimera.md §5): ``eager-opt`` (default): start a module's sync
right after the communication that follows its last backward, unless only one compute op
follows on the rank and it is a backward or input-gradient op (the two middle Chimera workers:
nothing to overlap with but that op, whose gradient message is on the critical path), in which
case it goes to the end; a single weight-gradient op that follows (split backward) exchanges no
message, so the sync overlaps it; ``eager``: always right after the last backward; ``end``: all
at the end. Every rank issues its syncs in one global order: by the planned time at which the
stage's gradient is complete on all its replicas (:func:`stage_ready_times`, from the plan's
reference timeline), ties late stage first (unsplit Chimera: always late stage first, as the
paper); a sync waits for the syncs before it in that order on its rank, so ranks that share one
process group for several stages issue them in the same order. Non-Chimera schedules always
sync at the end.

No torch import.
"""

from __future__ import annotations

import bisect
from typing import Sequence
from dataclasses import dataclass

from .dependencies import ACTIVATION, GRADIENT, execute_in_order, op_key, remote_inputs
from .instructions import Instruction, Kind

GRAD_SYNC_POLICIES = ("eager-opt", "eager", "end")
SEND, RECV = "send", "recv"


@dataclass(frozen=True, order=True)
class Message:
    """Identity of one tensor sent between stages.

    ``stage`` is the PRODUCING stage: an activation is the output of the forward of (pipeline,
    stage, microbatch) and is consumed by stage + 1; a gradient is the input gradient computed
    by the backward of (pipeline, stage, microbatch) and is consumed by stage - 1.
    """

    kind: str  # "activation" or "gradient"
    pipeline: int
    stage: int
    microbatch: int

    @property
    def consumer_stage(self) -> int:
        return self.stage + 1 if self.kind == ACTIVATION else self.stage - 1

    def __str__(self) -> str:
        letter = "a" if self.kind == ACTIVATION else "g"
        return f"{letter}{self.pipeline}.{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Message":
        kinds = {"a": ACTIVATION, "g": GRADIENT}
        try:
            pipeline, stage, microbatch = (int(part) for part in text[1:].split("."))
            return cls(kinds[text[0]], pipeline, stage, microbatch)
        except (KeyError, ValueError, IndexError) as error:
            raise ValueError(f"cannot parse message {text!r}; expected e.g. 'a0.1.3' or "
                             f"'g1.2.0'") from error


@dataclass(frozen=True)
class P2POp:
    """One send or receive of ``message`` to / from pipeline rank ``peer``."""

    direction: str  # "send" or "recv"
    peer: int
    message: Message

    def __str__(self) -> str:
        return f"{'>' if self.direction == SEND else '<'}{self.peer}:{self.message}"

    @classmethod
    def parse(cls, text: str) -> "P2POp":
        if text[:1] not in "<>" or ":" not in text:
            raise ValueError(f"cannot parse p2p op {text!r}; expected '>PEER:MSG' or '<PEER:MSG'")
        peer, message = text[1:].split(":", 1)
        return cls(SEND if text[0] == ">" else RECV, int(peer), Message.parse(message))


@dataclass(frozen=True)
class P2PGroup:
    """Sends and receives issued together (one batch_isend_irecv); completes as a whole."""

    ops: tuple[P2POp, ...]

    def __post_init__(self) -> None:
        assert self.ops, "a P2PGroup is never empty"

    def __str__(self) -> str:
        return "[" + ",".join(str(op) for op in self.ops) + "]"


@dataclass(frozen=True)
class GradSyncStart:
    """Start the gradient reduction of module (pipeline, stage), run by the rank's ``chunk``."""

    pipeline: int
    stage: int
    chunk: int = 0

    def __str__(self) -> str:
        text = f"S{self.pipeline}.{self.stage}"
        return text if self.chunk == 0 else f"{text}.{self.chunk}"


@dataclass(frozen=True)
class GradSyncWait:
    """Wait for every gradient reduction started by this rank."""

    def __str__(self) -> str:
        return "WAIT"


def parse_lowered_op(text: str):
    """Inverse of ``str()`` for every lowered op type."""
    text = text.strip()
    if text == "WAIT":
        return GradSyncWait()
    if text.startswith("["):
        if not text.endswith("]") or len(text) < 3:
            raise ValueError(f"cannot parse p2p group {text!r}")
        return P2PGroup(tuple(P2POp.parse(part) for part in text[1:-1].split(",")))
    if text.startswith("S"):
        parts = [int(part) for part in text[1:].split(".")]
        if len(parts) not in (2, 3):
            raise ValueError(f"cannot parse grad sync {text!r}; expected 'S<pipeline>.<stage>'")
        return GradSyncStart(*parts)
    return Instruction.parse(text)


def format_lowered(lowered) -> str:
    """One line per rank, lowered ops separated by spaces (round-trips with parse_lowered)."""
    return "\n".join(" ".join(str(op) for op in ops) for ops in lowered) + "\n"


def parse_lowered(text: str) -> list[list]:
    """Inverse of :func:`format_lowered`."""
    return [[parse_lowered_op(token) for token in line.split()]
            for line in text.splitlines() if line.strip()]


def _op_cost(op: Instruction, forward_cost: float, backward_cost: float) -> float:
    if op.kind is Kind.FORWARD:
        return forward_cost
    if op.kind is Kind.BACKWARD:
        return backward_cost
    return backward_cost / 2  # input-gradient and weight-gradient halves of a backward


def count_microbatches(schedule) -> int:
    """Instruction micro-batches of a schedule (1 + the largest index)."""
    return 1 + max((op.microbatch for ops in schedule for op in ops), default=-1)


def receive_points(ops, doubling_unit: int = 0, num_microbatches: int = 0) -> list[int]:
    """For each op of one rank, the index of the op before which its remote inputs arrive.

    Normally the op itself. Inside complete doubling units (forward doubling, backward halving;
    ``doubling_unit`` instruction micro-batches each, of the schedule's ``num_microbatches``) two
    adjacent forwards of one module form one doubled step: both inputs are received before the
    first forward, so the previous stage sends them together (one packed message).
    """
    points = list(range(len(ops)))
    if not doubling_unit:
        return points
    doubled_until = (num_microbatches // doubling_unit) * doubling_unit
    index = 0
    while index < len(ops) - 1:
        first, second = ops[index], ops[index + 1]
        if (first.kind is Kind.FORWARD and second.kind is Kind.FORWARD
                and first.module == second.module
                and first.microbatch < doubled_until and second.microbatch < doubled_until
                and first.microbatch // doubling_unit == second.microbatch // doubling_unit):
            points[index + 1] = index
            index += 2
        else:
            index += 1
    return points


def reference_timeline(schedule, num_stages: int, forward_cost: float = 1,
                       backward_cost: float = 2, doubling_unit: int = 0, stage_costs=None,
                       message_latency: float = 0.0) -> list[list[tuple[float, float]]]:
    """(start, end) of every op when each rank runs its list in order and every op starts as
    soon as its rank is free and its inputs exist (messages arrive instantly, or
    ``message_latency`` after their producer ends when it ran on another rank). The first op of
    a doubled forward step waits for the inputs of both (see :func:`receive_points`).
    ``stage_costs`` (a :class:`~.op_costs.StageCosts`) charges by stage instead."""
    keys = {op_key(op) for ops in schedule for op in ops}
    num_microbatches = count_microbatches(schedule)
    needs = []
    for ops in schedule:
        rank_needs = [[key for _, key in remote_inputs(op, num_stages, keys)] for op in ops]
        for index, point in enumerate(receive_points(ops, doubling_unit, num_microbatches)):
            if point != index:
                rank_needs[point] = rank_needs[point] + rank_needs[index]
                rank_needs[index] = []
        needs.append(rank_needs)
    finished = {}  # op key -> end time
    produced_on = {}  # op key -> rank that ran it
    times = [[] for _ in schedule]
    clock = [0.0] * len(schedule)

    def run(rank: int, index: int) -> None:
        op = schedule[rank][index]
        start = max([clock[rank]] + [finished[key] + (message_latency if produced_on[key] != rank
                                                      else 0.0)
                                     for key in needs[rank][index]])
        end = start + (_op_cost(op, forward_cost, backward_cost) if stage_costs is None
                       else stage_costs.cost(op))
        finished[op_key(op)] = end
        produced_on[op_key(op)] = rank
        times[rank].append((start, end))
        clock[rank] = end

    counters = execute_in_order(schedule, needs, run)
    if any(counters[rank] < len(ops) for rank, ops in enumerate(schedule)):
        raise ValueError("schedule dependencies cannot be satisfied; run validate_schedule "
                         "for a report")
    return times


def lower_schedule(schedule, layout, grad_sync_policy: str = "eager-opt",
                   plan_forward_cost: float = 1, plan_backward_cost: float = 2,
                   doubled_step_messages: bool = False, stage_costs=None,
                   eager_sends: bool = False) -> list[list]:
    """Per rank, the lowered op list (compute, P2PGroup, GradSyncStart, GradSyncWait).

    ``plan_forward_cost`` / ``plan_backward_cost`` only shape where communication is grouped
    (see the module docstring); any positive values give a correct, deadlock-free result.
    ``doubled_step_messages`` (forward doubling, backward halving): receive both inputs of a
    doubled forward step before its first forward, so the two activations share one group and,
    with packing, one message per peer (25% fewer messages for these variants). It costs up to
    one forward per stage boundary while the pipeline fills (D=8, N=16, F=1, B=2: makespan 60
    instead of 57 without message latency), so it is only worth it with packing.
    ``stage_costs`` (optional :class:`~.op_costs.StageCosts`, per instruction micro-batch) replaces
    the two plan costs, e.g. the table a split backward was placed with. ``eager_sends``: issue
    each message right after its producer (see the module docstring; for message latency > 0).
    """
    if grad_sync_policy not in GRAD_SYNC_POLICIES:
        raise ValueError(f"unknown gradient sync policy {grad_sync_policy!r}; allowed: "
                         f"{', '.join(GRAD_SYNC_POLICIES)}")
    doubling_unit = layout.doubling_unit if doubled_step_messages else 0
    times = reference_timeline(schedule, layout.num_stages, plan_forward_cost, plan_backward_cost,
                               doubling_unit, stage_costs)
    groups = _p2p_groups(schedule, layout, times, doubling_unit, eager_sends)
    ready = stage_ready_times(schedule, times)

    def sync_order(module) -> tuple:
        # One order on every rank (from the global plan): stages whose gradients are complete
        # earlier first, ties (and unsplit Chimera, whose late stage finishes first) late stage
        # first; a stage without backward this iteration last.
        return (ready.get(module[1], float("inf")), -module[1], module[0])
    lowered = []
    for rank, ops in enumerate(schedule):
        rank_ops = []
        for position in range(len(ops) + 1):
            rounds = groups.get((rank, position))
            if rounds:
                for _, group_ops in sorted(rounds.items()):
                    rank_ops.append(P2PGroup(tuple(sorted(group_ops, key=_p2p_sort_key))))
            if position < len(ops):
                rank_ops.append(ops[position])
        lowered.append(_add_grad_sync(rank, rank_ops, layout, grad_sync_policy, sync_order))
    return lowered


def stage_ready_times(schedule, times) -> dict:
    """{stage: planned end of its last backward-type op on any rank} (``times`` from
    :func:`reference_timeline`): when every replica of the stage has its gradient."""
    ready: dict = {}
    for ops, rank_times in zip(schedule, times):
        for op, (_, end) in zip(ops, rank_times):
            if op.kind is not Kind.FORWARD:
                ready[op.stage] = max(ready.get(op.stage, end), end)
    return ready


def _p2p_sort_key(op: P2POp):
    message = op.message
    return (op.peer, 0 if op.direction == SEND else 1, message.kind, message.pipeline,
            message.stage, message.microbatch)


def _p2p_groups(schedule, layout, times, doubling_unit: int = 0,
                eager_sends: bool = False) -> dict:
    """{(rank, position): {round: [P2POp]}}: a group is issued before op ``position``."""
    where = {}  # op key -> (rank, index)
    for rank, ops in enumerate(schedule):
        for index, op in enumerate(ops):
            where[op_key(op)] = (rank, index)
    starts = [[start for start, _ in rank_times] for rank_times in times]
    ends = [[end for _, end in rank_times] for rank_times in times]
    keys = set(where)
    num_microbatches = count_microbatches(schedule)
    groups: dict = {}
    sends: list = []
    for consumer_rank, ops in enumerate(schedule):
        points = receive_points(ops, doubling_unit, num_microbatches)
        for consumer_index, op in enumerate(ops):
            for kind, producer in remote_inputs(op, layout.num_stages, keys):
                producer_rank, _ = where[producer]
                assert producer_rank != consumer_rank, (
                    f"{op} and its producer run on the same rank {consumer_rank}")
                message = Message(kind, producer[1], producer[2], producer[3])
                # Receiver: just before the consumer, or before the first forward of its doubled
                # step (the first op starting at round_time).
                recv_position = points[consumer_index]
                round_time = starts[consumer_rank][recv_position]
                # Sender: after every op that ends by the round (includes the producer), or
                # eagerly right after the producer.
                send_position = (where[producer][1] + 1 if eager_sends
                                 else _count_at_most(ends[producer_rank], round_time))
                groups.setdefault((consumer_rank, recv_position), {}).setdefault(
                    round_time, []).append(P2POp(RECV, producer_rank, message))
                sends.append((producer_rank, consumer_rank, round_time, send_position, message))
    for producer_rank, send_position, round_time, p2p in _ordered_sends(sends):
        groups.setdefault((producer_rank, send_position), {}).setdefault(
            round_time, []).append(p2p)
    return groups


def _ordered_sends(sends):
    """(rank, position, round, P2POp) of every send, its position raised so that on every link
    the rounds' positions never decrease and one round's messages share one position (a no-op
    for the default rule, whose positions already are)."""
    latest: dict = {}  # (sender, receiver) -> position of the latest round so far
    by_round: dict = {}  # (sender, receiver, round) -> [position, messages]
    for sender, receiver, round_time, position, message in sends:
        entry = by_round.setdefault((sender, receiver, round_time), [0, []])
        entry[0] = max(entry[0], position)
        entry[1].append(message)
    result = []
    for (sender, receiver, round_time), (position, messages) in sorted(by_round.items()):
        position = max(position, latest.get((sender, receiver), 0))
        latest[(sender, receiver)] = position
        result += [(sender, position, round_time, P2POp(SEND, receiver, message))
                   for message in messages]
    return result


def _count_at_most(sorted_values, limit) -> int:
    """Number of values <= limit in an increasing list (with a tolerance for float sums)."""
    low, high = 0, len(sorted_values)
    while low < high:
        middle = (low + high) // 2
        if sorted_values[middle] <= limit + 1e-9:
            low = middle + 1
        else:
            high = middle
    return low


def _add_grad_sync(rank: int, rank_ops: list, layout, policy: str, sync_order) -> list:
    """Insert one GradSyncStart per module hosted by ``rank`` (per policy), then GradSyncWait.

    ``sync_order`` (module -> sort key, the same on every rank) orders the syncs."""
    compute_positions = [i for i, op in enumerate(rank_ops) if isinstance(op, Instruction)]
    last_backward = {}  # module -> index in rank_ops of its last backward-type op
    for index in compute_positions:
        op = rank_ops[index]
        if op.kind is not Kind.FORWARD:
            last_backward[op.module] = index
    # Syncs are issued in one order on every rank (so ranks sharing a process group for several
    # stages pair the right buckets): a sync goes at its eager position or right after the
    # previous sync in that order, whichever is later.
    insert_at_by_module = {}
    earliest = 0
    for module in sorted(layout.hosted(rank), key=sync_order):
        if module not in last_backward:
            # A module with no micro-batch this iteration (e.g. N < number of pipelines) still
            # joins its stage's all-reduce (zero gradient), or the replicas would hang.
            insert_at_by_module[module] = earliest = len(rank_ops)
            continue
        index = last_backward[module]
        later = [rank_ops[i] for i in compute_positions[bisect.bisect_right(compute_positions,
                                                                             index):]]
        # eager-opt skips the eager launch where a single backward follows (the paper's middle
        # workers: it would share the link with that backward's gradient message); weight
        # halves exchange nothing, so a sync overlaps them.
        eager = layout.has_stage_replicas and len(later) > 0 and (
            policy == "eager" or (policy == "eager-opt" and (
                len(later) > 1 or later[0].kind is Kind.BACKWARD_WEIGHT)))
        if eager:
            # After the communication that directly follows the backward (its gradient send).
            insert_at = index + 1
            while insert_at < len(rank_ops) and isinstance(rank_ops[insert_at], P2PGroup):
                insert_at += 1
        else:
            insert_at = len(rank_ops)
        earliest = max(earliest, insert_at)
        insert_at_by_module[module] = earliest
    eager_after = {}  # index in rank_ops before which syncs are inserted -> modules
    for module, insert_at in insert_at_by_module.items():
        eager_after.setdefault(insert_at, []).append(module)
    result: list = []
    for index, op in enumerate(rank_ops):
        for module in sorted(eager_after.get(index, []), key=sync_order):
            result.append(_sync_start(module, layout))
        result.append(op)
    for module in sorted(eager_after.get(len(rank_ops), []), key=sync_order):
        result.append(_sync_start(module, layout))
    result.append(GradSyncWait())
    return result


def _sync_start(module, layout) -> GradSyncStart:
    pipeline, stage = module
    return GradSyncStart(pipeline, stage, layout.chunk(pipeline, stage))


def forward_only_ops(ops: Sequence) -> list:
    """The ops of a forward-only pass (evaluation): forwards and activation messages only.

    Dropping whole messages on both sides keeps every group matched, and removing ops never adds
    a wait, so the result is deadlock-free whenever the full list is.
    """
    result: list = []
    for op in ops:
        if isinstance(op, Instruction) and op.kind is Kind.FORWARD:
            result.append(op)
        elif isinstance(op, P2PGroup):
            kept = tuple(p2p for p2p in op.ops if p2p.message.kind == ACTIVATION)
            if kept:
                result.append(P2PGroup(kept))
    return result
