"""Simulate all ranks of a lowered schedule together with costs.

Semantics (what ``simulate`` assumes about the runtime):

* Compute: a rank runs its ops in order; a forward costs ``forward_cost``, a backward
  ``backward_cost`` (split backward halves cost half each); either may be a function of the
  instruction instead of a number (per-stage costs). Costs are per instruction: a
  doubled forward step of forward doubling is two forward instructions, 2F in total. For
  backward halving the instructions are half micro-batches; pass halved costs (see
  :func:`simulate_schedule`, which does it from the layout).
* Point-to-point, ``p2p_semantics="async"`` (what the runtime does): a P2PGroup takes no time
  on the rank. Its sends are posted when the rank reaches the group; its receives are posted
  earlier, when the rank starts the compute op before the group (prefetch; at time 0 when there is
  none). A message arrives at max(send post, receive post) + ``p2p_cost``; the compute op that
  consumes it starts no earlier. Sends complete in the background; the rank's last op (GradSyncWait)
  waits for all of them. A rank is stuck only while a message it needs has not been sent.
* Point-to-point, ``p2p_semantics="rendezvous"`` (a blocking exchange per group): a rank posts all
  ops of a P2PGroup at once and then waits; a send and its receive complete together at
  max(post time of sender's group, post time of receiver's group) + ``p2p_cost``; the group
  completes when all its ops have.
* Either way, a compute op whose input message was never posted for receipt is a lowering
  error.
* Gradient sync: GradSyncStart takes no time on the rank; the all-reduce of stage s completes
  ``allreduce_cost`` after the last of the ranks that start a sync of stage s (any pipeline)
  has started it. GradSyncWait waits for all syncs the rank started.

Results: per-rank timelines (op, start, end) of every op, the makespan (latest end over ranks),
the bubble ratio = idle compute time / total time over ranks
= 1 - sum of compute time / (number of ranks x makespan) (time spent in communication counts as
idle), and the peak number of stored activations per rank (forwards whose backward has not
finished: +1 at a forward, -1 at a backward or at a weight-gradient backward), in instruction
micro-batches.

A rank that can never proceed raises :class:`DeadlockError` printing the rank x step grid
with every stuck op marked. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .dependencies import op_key, remote_inputs
from .grid import format_op_grid
from .instructions import Instruction, Kind
from .lowering import RECV, SEND, GradSyncStart, GradSyncWait, Message, P2PGroup


class DeadlockError(RuntimeError):
    """The lowered schedule cannot finish; the message shows the stuck ops."""


class LoweringError(RuntimeError):
    """A compute op would run without the message it needs."""


@dataclass(frozen=True)
class TimelineEntry:
    op: object
    start: float
    end: float


@dataclass
class SimulationResult:
    timelines: list[list[TimelineEntry]]
    makespan: float
    bubble_ratio: float
    peak_activations: list[int]
    compute_time: list[float] = field(default_factory=list)

    def compute_timelines(self) -> list[list[TimelineEntry]]:
        """Timelines restricted to compute instructions."""
        return [[entry for entry in timeline if isinstance(entry.op, Instruction)]
                for timeline in self.timelines]


def _compute_cost(op: Instruction, forward_cost, backward_cost):
    """Cost of one compute op; a cost may be a number or a function of the op (per-stage
    costs, e.g. a last stage that also runs the output layer)."""
    if callable(forward_cost):
        forward_cost = forward_cost(op)
    if callable(backward_cost):
        backward_cost = backward_cost(op)
    if op.kind is Kind.FORWARD:
        return forward_cost
    if op.kind is Kind.BACKWARD:
        return backward_cost
    return backward_cost / 2


def peak_activations(ops) -> int:
    """Most activations stored at once by a rank running ``ops`` in order."""
    stored = peak = 0
    for op in ops:
        if not isinstance(op, Instruction):
            continue
        if op.kind is Kind.FORWARD:
            stored += 1
            peak = max(peak, stored)
        elif op.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            stored -= 1
    return peak


def _num_stages(lowered) -> dict:
    stages = {}
    for ops in lowered:
        for op in ops:
            if isinstance(op, Instruction):
                stages[op.pipeline] = max(stages.get(op.pipeline, 0), op.stage + 1)
    return stages


def _message_key(message: Message) -> tuple:
    return (message.kind, message.pipeline, message.stage, message.microbatch)


def _prepare(lowered):
    """Per rank, a compact form of each op for the event loop (tuples hash much faster than
    dataclasses): ("compute", op, needed message keys) | ("group", op, [(own key, partner
    key, received message key or None)]) | ("sync", op) | ("wait", op)."""
    stages_per_pipeline = _num_stages(lowered)
    all_keys = {op_key(op) for ops in lowered for op in ops if isinstance(op, Instruction)}
    prepared = []
    for rank, ops in enumerate(lowered):
        rank_ops = []
        for op in ops:
            if isinstance(op, Instruction):
                needed = tuple((kind, producer[1], producer[2], producer[3]) for kind, producer
                               in remote_inputs(op, stages_per_pipeline[op.pipeline], all_keys))
                rank_ops.append(("compute", op, needed))
            elif isinstance(op, P2PGroup):
                entries = []
                for p2p in op.ops:
                    message = _message_key(p2p.message)
                    if p2p.direction == SEND:
                        own, other = (rank, p2p.peer, message), (rank, p2p.peer, message, RECV)
                        entries.append(((*own, SEND), other, None))
                    else:
                        own, other = (p2p.peer, rank, message), (p2p.peer, rank, message, SEND)
                        entries.append(((*own, RECV), other, message))
                rank_ops.append(("group", op, entries))
            elif isinstance(op, GradSyncStart):
                rank_ops.append(("sync", op))
            elif isinstance(op, GradSyncWait):
                rank_ops.append(("wait", op))
            else:
                raise TypeError(f"unknown lowered op {op!r} on rank {rank}")
        prepared.append(rank_ops)
    return prepared


P2P_SEMANTICS = ("async", "rendezvous")


def simulate(lowered, forward_cost: float = 1, backward_cost: float = 2, p2p_cost: float = 0,
             allreduce_cost: float = 0, p2p_semantics: str = "rendezvous") -> SimulationResult:
    """Run every rank of ``lowered`` together; see the module docstring for the semantics."""
    if p2p_semantics not in P2P_SEMANTICS:
        raise ValueError(f"unknown p2p semantics {p2p_semantics!r}; allowed: "
                         f"{', '.join(P2P_SEMANTICS)}")
    loop = _EventLoop(lowered, (forward_cost, backward_cost, p2p_cost, allreduce_cost),
                      asynchronous=p2p_semantics == "async")
    loop.run()
    makespan = max(loop.clock, default=0.0)
    total = len(lowered) * makespan
    bubble = (1 - sum(loop.busy) / total) if total > 0 else 0.0
    return SimulationResult(loop.timelines, makespan, bubble,
                            [peak_activations(ops) for ops in lowered], loop.busy)


class _EventLoop:
    """State of one simulation: every rank advances through its ops while it can (one method per
    op kind; each returns the op's end time, or None when the rank must wait)."""

    def __init__(self, lowered, costs: tuple, asynchronous: bool):
        self.lowered = lowered
        self.forward_cost, self.backward_cost, self.p2p_cost, self.allreduce_cost = costs
        self.asynchronous = asynchronous
        num_ranks = len(lowered)
        self.prepared = _prepare(lowered)
        self.sync_participants: dict = {}
        for rank, ops in enumerate(lowered):
            for op in ops:
                if isinstance(op, GradSyncStart):
                    self.sync_participants.setdefault(op.stage, set()).add(rank)
        self.posted: dict = {}  # (sender, receiver, message key, direction) -> post time
        self.received = [set() for _ in range(num_ranks)]  # message keys received per rank
        self.sync_starts: dict = {}  # stage -> {rank: start time}
        self.started_syncs = [[] for _ in range(num_ranks)]
        self.timelines = [[] for _ in range(num_ranks)]
        self.clock = [0.0] * num_ranks
        self.counters = [0] * num_ranks
        self.busy = [0.0] * num_ranks
        self.compute_start = [0.0] * num_ranks  # async: start of the rank's latest compute op
        self.sent = [[] for _ in range(num_ranks)]  # async: (own key, partner key) per send
        self.receive_of = [{} for _ in range(num_ranks)]  # async: message -> (own, partner)

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for rank in range(len(self.lowered)):
                while self.counters[rank] < len(self.prepared[rank]) and self._step(rank):
                    progress = True
        self._raise_if_stuck()

    def _step(self, rank: int) -> bool:
        entry = self.prepared[rank][self.counters[rank]]
        kind, op, now = entry[0], entry[1], self.clock[rank]
        handler = {"compute": self._compute, "group": self._group, "sync": self._sync_start,
                   "wait": self._sync_wait}[kind]
        timing = handler(rank, entry, now)
        if timing is None:
            return False
        start, end = timing
        self.timelines[rank].append(TimelineEntry(op, start, end))
        self.clock[rank] = end
        self.counters[rank] += 1
        return True

    def _arrival(self, own, other):
        """When a posted message arrives (async); None while its partner is not posted."""
        partner_time = self.posted.get(other)
        if partner_time is None:
            return None
        return max(self.posted[own], partner_time) + self.p2p_cost

    def _compute(self, rank: int, entry, now: float):
        op, needed = entry[1], entry[2]
        for message in needed:
            if message not in self.received[rank]:
                raise LoweringError(f"rank {rank} runs {op} without having received "
                                    f"{Message(*message)}")
        if self.asynchronous:
            arrivals = [self._arrival(*self.receive_of[rank][message]) for message in needed]
            if None in arrivals:
                return None
            now = max([now] + arrivals)
            self.compute_start[rank] = now
        end = now + _compute_cost(op, self.forward_cost, self.backward_cost)
        self.busy[rank] += end - now
        return now, end

    def _group(self, rank: int, entry, now: float):
        if self.asynchronous:  # sends posted now, receives when the previous compute started
            for own, other, message in entry[2]:
                if message is None:
                    self.posted.setdefault(own, now)
                    self.sent[rank].append((own, other))
                else:
                    self.posted.setdefault(own, self.compute_start[rank])
                    self.receive_of[rank][message] = (own, other)
                    self.received[rank].add(message)
            return now, now
        latest = now  # rendezvous: the group completes once every partner has posted
        for own, _, _ in entry[2]:
            self.posted.setdefault(own, now)
        for _, other, _ in entry[2]:
            partner_time = self.posted.get(other)
            if partner_time is None:
                return None
            latest = max(latest, partner_time)
        self.received[rank].update(message for _, _, message in entry[2] if message is not None)
        return now, latest + self.p2p_cost

    def _sync_start(self, rank: int, entry, now: float):
        stage = entry[1].stage
        self.sync_starts.setdefault(stage, {})[rank] = now
        self.started_syncs[rank].append(stage)
        return now, now

    def _sync_wait(self, rank: int, entry, now: float):
        completions = []
        for stage in self.started_syncs[rank]:
            starts = self.sync_starts.get(stage, {})
            if len(starts) != len(self.sync_participants[stage]):
                return None
            completions.append(max(starts.values()) + self.allreduce_cost)
        for own, other in self.sent[rank] if self.asynchronous else ():
            completion = self._arrival(own, other)
            if completion is None:
                return None
            completions.append(completion)
        return now, max([now] + completions)

    def _raise_if_stuck(self) -> None:
        stuck = [(rank, self.counters[rank]) for rank in range(len(self.lowered))
                 if self.counters[rank] < len(self.lowered[rank])]
        if stuck:
            rows = [[str(op) for op in ops] for ops in self.lowered]
            raise DeadlockError(
                "deadlock: ranks " + ", ".join(str(rank) for rank, _ in stuck)
                + " wait forever at the marked ops\n"
                + format_op_grid(rows, stuck, max_columns=24, title="rank x step grid:"))


def simulate_plan(plan, forward_cost: float = 1, backward_cost: float = 2, p2p_cost: float = 0,
                  allreduce_cost: float = 0) -> SimulationResult:
    """Simulate a :class:`~.plan.PipelinePlan` as the runtime executes it (asynchronous p2p);
    costs per micro-batch of --micro-batch-size (scaled by the layout's micro-batch fraction,
    half for backward halving)."""
    fraction = float(plan.layout.microbatch_fraction)
    return simulate(plan.lowered, forward_cost * fraction, backward_cost * fraction, p2p_cost,
                    allreduce_cost, p2p_semantics="async")


def simulate_schedule(name: str, pipeline_size: int, num_microbatches: int,
                      forward_cost: float = 1, backward_cost: float = 2, p2p_cost: float = 0,
                      allreduce_cost: float = 0, grad_sync_policy: str = "eager-opt",
                      registry=None, **options):
    """Plan (with the simulation costs as planning costs) and simulate one schedule; returns
    (schedule, lowered, result)."""
    from .plan import make_plan
    from .schedules import BUILTIN_SCHEDULES

    plan = make_plan(name, pipeline_size, num_microbatches, options,
                     grad_sync_policy=grad_sync_policy, forward_cost=forward_cost,
                     backward_cost=backward_cost, registry=registry or BUILTIN_SCHEDULES)
    result = simulate_plan(plan, forward_cost, backward_cost, p2p_cost, allreduce_cost)
    return [list(ops) for ops in plan.schedule], [list(ops) for ops in plan.lowered], result
