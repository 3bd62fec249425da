"""Split backward for any schedule: weight-gradient work moved into the pipeline's idle slots.

Zero-bubble pipelines (Qi et al., 2023) split each backward B into the input-gradient half I (the
message the previous stage waits for: on the critical path) and the weight-gradient half W (needed
only before the optimizer step). :func:`split_backward_schedule` takes any schedule of forwards and
backwards, keeps every rank's order of F and B (each B becomes an I) and places the W ops by a
list-scheduling simulation with unit costs (F = I = W, i.e. B = 2F split evenly): a rank runs its
next F or I as soon as its inputs have arrived; while it waits for one, it runs the oldest pending W;
the W ops left at the end form the tail. Deferring a W keeps that micro-batch's activations stored,
so a rank runs pending W ops first whenever a forward would take its stored activations above the
base schedule's largest per-rank peak plus ``extra_activations``: with 0, the peak memory of the
busiest rank is unchanged and less busy ranks use their headroom.

Applied to 1F1B this gives ZB-H1 (Qi et al.: makespan 3N + D - 1 with F = I = W, at 1F1B's peak
memory); applied to Chimera (any variant) it fills Chimera's remaining bubbles: 3N + D/2 - 1 for
direct concatenation at N >= D, at Chimera's peak memory.
The result is an ordinary schedule of F, I and W instructions: the validator, lowering, simulator and
runtime handle it like any other. No torch import.
"""

from __future__ import annotations

from collections import deque

from ..dependencies import op_key, peak_activations, remote_inputs
from ..instructions import Instruction, Kind


def _split(op: Instruction, kind: Kind) -> Instruction:
    return Instruction(kind, op.pipeline, op.stage, op.microbatch, op.chunk)


class _Rank:
    """One rank's state in the list-scheduling simulation."""

    def __init__(self, base_ops, limit: int):
        self.main = [_split(op, Kind.BACKWARD_INPUT) if op.kind is Kind.BACKWARD else op
                     for op in base_ops]
        self.next = 0
        self.pending = deque()  # W ops whose I has run
        self.stored = 0
        self.limit = limit
        self.clock = 0.0
        self.ops: list[Instruction] = []

    @property
    def done(self) -> bool:
        return self.next == len(self.main) and not self.pending

    def must_run_weight_first(self) -> bool:
        op = self.main[self.next]
        return bool(self.pending) and op.kind is Kind.FORWARD and self.stored >= self.limit


def _next_action(rank: _Rank, needs: dict, finish: dict):
    """(start time, op) this rank would run next, or None while an input's producer has not run."""
    if rank.next == len(rank.main):
        return rank.clock, rank.pending[0]
    if rank.must_run_weight_first():
        return rank.clock, rank.pending[0]
    op = rank.main[rank.next]
    producers = needs[op_key(op)]
    if all(key in finish for key in producers):
        ready = max([rank.clock] + [finish[key] for key in producers])
        if ready <= rank.clock or not rank.pending:
            return ready, op
    if rank.pending:  # fill the wait with the oldest weight-gradient work
        return rank.clock, rank.pending[0]
    return None


def split_backward_schedule(schedule, num_stages: int, extra_activations: int = 0,
                            costs=(1.0, 1.0, 1.0)) -> list[list[Instruction]]:
    """Per rank, ``schedule`` with each B split into I and W and the W ops placed in idle slots.

    ``extra_activations``: how many micro-batches' activations a rank may keep stored beyond the
    base schedule's largest per-rank peak in order to defer weight work (0: the schedule's peak
    memory is unchanged). ``costs``: (F, I, W) used to
    place the W ops.
    """
    if extra_activations < 0:
        raise ValueError(f"extra stored activations must be >= 0, got {extra_activations}")
    limit = max(peak_activations(ops) for ops in schedule) + extra_activations
    ranks = [_Rank(ops, limit) for ops in schedule]
    split_keys = {op_key(op) for rank in ranks for op in rank.main}
    needs = {op_key(op): [key for _, key in remote_inputs(op, num_stages, split_keys)]
             for rank in ranks for op in rank.main}
    cost = {Kind.FORWARD: costs[0], Kind.BACKWARD_INPUT: costs[1], Kind.BACKWARD_WEIGHT: costs[2]}
    finish: dict = {}
    while not all(rank.done for rank in ranks):
        candidates = [(action[0], index, action[1]) for index, rank in enumerate(ranks)
                      if not rank.done and (action := _next_action(rank, needs, finish))]
        if not candidates:
            raise ValueError("split_backward_schedule: the base schedule's dependencies cannot "
                             "be satisfied; validate it first")
        start, index, op = min(candidates, key=lambda item: (item[0], item[1]))
        rank = ranks[index]
        if op.kind is Kind.BACKWARD_WEIGHT:
            rank.pending.popleft()
            rank.stored -= 1
        else:
            rank.next += 1
            if op.kind is Kind.FORWARD:
                rank.stored += 1
            else:
                rank.pending.append(_split(op, Kind.BACKWARD_WEIGHT))
        rank.clock = start + cost[op.kind]
        finish[op_key(op)] = rank.clock
        rank.ops.append(op)
    return [rank.ops for rank in ranks]
