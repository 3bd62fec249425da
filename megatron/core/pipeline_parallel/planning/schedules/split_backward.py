"""Split backward for any schedule: weight-gradient work moved into the pipeline's idle slots.

Zero-bubble pipelines (Qi et al., 2023) split each backward B into the input-gradient half I (the
message the previous stage waits for: on the critical path) and the weight-gradient half W (needed
only before the optimizer step). :func:`split_backward_schedule` takes any schedule of forwards and
backwards, keeps every rank's order of F and B (each B becomes an I) and places the W ops by a
list-scheduling simulation with the charges the runtime spends (:class:`~..op_costs.StageCosts`;
default F = 1, B = 2 split evenly, except that a first stage has no input gradient: its I is free
and its whole backward is the W, deferrable like any other): a rank runs its
next F or I as soon as its inputs have arrived; while it waits for one, it runs the oldest pending W;
the W ops left at the end form the tail. Deferring a W keeps that micro-batch's activations stored,
so a rank runs pending W ops first whenever a forward would take its stored activations above the
base schedule's largest per-rank peak plus ``extra_activations``: with 0, the peak memory of the
busiest rank is unchanged and less busy ranks use their headroom.

A first stage's backward is either split (I free, the whole backward a deferrable W) or kept whole;
by default both placements are tried and the shorter kept. Charged as the runtime runs (first
stage I = 0, W = B = 2F), applied to 1F1B this gives ZB-H1 (Qi et al.: makespan 3N + D - 1 at
1F1B's peak memory) and applied to Chimera direct with P pipelines 3N + D/P - 1 at N >= D, at
Chimera's peak memory (docs/schedules.md).
Latency-tolerant placement: when the stage table carries a message latency δ > 0
(:class:`~..op_costs.StageCosts`), an input from another rank arrives δ after its producer ends, and
a known wait is filled with the oldest W only when it is longer than ρ times that W (ρ = 0 fills any
wait, the free-message rule; filling a δ-long wait with a whole W delays the next F or I by W - δ).
The placement is tried with ρ in :data:`LATENCY_FILL_RATIOS` (and first stages deferred or not) and
the shortest kept; its timeline equals the simulator's when the lowering sends eagerly (what
:func:`~..plan.make_plan` does for δ > 0). With δ = 0 nothing changes.
The result is an ordinary schedule of F, I and W (and whole first-stage B) instructions: the validator, lowering, simulator and
runtime handle it like any other. No torch import.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from ..dependencies import op_key, peak_activations, remote_inputs
from ..instructions import Instruction, Kind
from ..op_costs import StageCosts, uniform_stage_costs


def _split(op: Instruction, kind: Kind) -> Instruction:
    return Instruction(kind, op.pipeline, op.stage, op.microbatch, op.chunk)


class _Rank:
    """One rank's state in the list-scheduling simulation."""

    def __init__(self, base_ops, limit: int, defer_first_stage: bool):
        self.main = [_split(op, Kind.BACKWARD_INPUT)
                     if op.kind is Kind.BACKWARD and (defer_first_stage or op.stage > 0) else op
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


def _next_action(rank: _Rank, needs: dict, finish: dict, tolerance):
    """(start time, op) this rank would run next, or None while an input's producer has not run.
    ``tolerance`` = (message latency, fill ratio, charge): an input from another rank arrives the
    latency after its producer ends; a known wait is filled with a W only when it is longer than
    fill ratio x that W's charge (0: any wait)."""
    if rank.next == len(rank.main):
        return rank.clock, rank.pending[0]
    if rank.must_run_weight_first():
        return rank.clock, rank.pending[0]
    op = rank.main[rank.next]
    producers = needs[op_key(op)]
    if all(key in finish for key in producers):
        latency, fill_ratio, charge = tolerance
        ready = max([rank.clock] + [finish[key] + latency for key in producers])
        if not rank.pending or ready - rank.clock <= fill_ratio * charge(rank.pending[0]):
            return ready, op
    if rank.pending:  # fill the wait with the oldest weight-gradient work
        return rank.clock, rank.pending[0]
    return None


def split_backward_schedule(schedule, num_stages: int, extra_activations: int = 0,
                            stage_costs: StageCosts | None = None,
                            defer_first_stage: Optional[bool] = None) -> list[list[Instruction]]:
    """Per rank, ``schedule`` with each B split into I and W and the W ops placed in idle slots.

    ``extra_activations``: how many micro-batches' activations a rank may keep stored beyond the
    base schedule's largest per-rank peak in order to defer weight work (0: the schedule's peak
    memory is unchanged). ``stage_costs``: the charges used to place the W ops, per instruction
    micro-batch (default :func:`~..op_costs.uniform_stage_costs`). ``defer_first_stage``: True
    splits the first stages' backwards too (I free, the whole backward deferrable weight work);
    False keeps them whole where the base schedule has them; None (default) places both ways and
    keeps the shorter (ties: whole). Deferring a first stage's 2-unit backward into a 1-unit wait
    delays that rank's next input gradient, so with two Chimera pipelines keeping it whole wins.
    """
    return split_backward_placement(schedule, num_stages, extra_activations, stage_costs,
                                    defer_first_stage)[0]


def split_backward_placement(schedule, num_stages: int, extra_activations: int = 0,
                             stage_costs: StageCosts | None = None,
                             defer_first_stage: Optional[bool] = None):
    """(per-rank ops, makespan the placement expects) of :func:`split_backward_schedule`: with
    free messages the simulator gives the same makespan (it charges the same)."""
    if extra_activations < 0:
        raise ValueError(f"extra stored activations must be >= 0, got {extra_activations}")
    limit = max(peak_activations(ops) for ops in schedule) + extra_activations
    costs = stage_costs or uniform_stage_costs(num_stages)
    choices = (False, True) if defer_first_stage is None else (defer_first_stage,)
    latency = costs.message_latency
    fill_ratios = LATENCY_FILL_RATIOS if latency > 0 else (0.0,)
    placed = [_place(schedule, num_stages, limit, costs.cost, defer, (latency, ratio))
              for defer in choices for ratio in fill_ratios]
    return min(placed, key=lambda result: result[1])


# Fill ratios a latency-tolerant placement tries (the wait a W may fill, in units of that W).
LATENCY_FILL_RATIOS = (0.0, 0.1, 0.25, 0.5)


def _place(schedule, num_stages: int, limit: int, charge, defer_first_stage: bool,
           latency_fill=(0.0, 0.0)):
    """(per-rank ops, makespan of the placement's list-scheduling simulation);
    ``latency_fill`` = (message latency, fill ratio), see :func:`_next_action`."""
    ranks = [_Rank(ops, limit, defer_first_stage) for ops in schedule]
    split_keys = {op_key(op) for rank in ranks for op in rank.main}
    needs = {op_key(op): [key for _, key in remote_inputs(op, num_stages, split_keys)]
             for rank in ranks for op in rank.main}
    finish: dict = {}
    tolerance = (latency_fill[0], latency_fill[1], charge)
    while not all(rank.done for rank in ranks):
        candidates = [(action[0], index, action[1]) for index, rank in enumerate(ranks)
                      if not rank.done and (action := _next_action(rank, needs, finish,
                                                                   tolerance))]
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
            elif op.kind is Kind.BACKWARD:
                rank.stored -= 1
            else:
                rank.pending.append(_split(op, Kind.BACKWARD_WEIGHT))
        rank.clock = start + charge(op)
        finish[op_key(op)] = rank.clock
        rank.ops.append(op)
    return [rank.ops for rank in ranks], max((rank.clock for rank in ranks), default=0.0)
