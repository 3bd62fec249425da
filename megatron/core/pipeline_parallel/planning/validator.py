"""Checks that a schedule (per-rank compute instruction lists) can be executed correctly.

``validate_schedule`` verifies, against a :class:`ScheduleLayout`:

1. one list per pipeline rank, and every instruction on the rank that hosts its
   (pipeline, stage), with the chunk index of that rank;
2. every (pipeline, stage, micro-batch) has exactly one forward and one backward (or one
   input-gradient plus one weight-gradient backward), every stage of a pipeline sees the same
   micro-batches, and each micro-batch belongs to exactly one pipeline (all of 0 .. M-1 when
   the number of micro-batches is given);
3. a backward follows its forward on the rank;
4. each (pipeline, stage) runs its forwards, and its backwards, in micro-batch order;
5. micro-batches are split evenly between pipelines (counts differ by at most one);
6. the cross-rank dependencies are satisfiable: executing every rank's list in order, with
   messages delivered as soon as they are produced, finishes.

A failure raises :class:`ScheduleError` whose message prints the rank x step grid with the
offending steps marked ``>like this<``. No torch import.
"""

from __future__ import annotations

from collections import Counter

from .dependencies import execute_in_order, local_inputs, op_key, remote_inputs
from .grid import format_op_grid
from .instructions import Kind


class ScheduleError(ValueError):
    """A schedule cannot run as given; the message shows the grid with the problem marked."""


def _fail(schedule, problem: str, marks=()) -> None:
    rows = [[str(op) for op in ops] for ops in schedule]
    raise ScheduleError(f"invalid pipeline schedule: {problem}\n"
                        + format_op_grid(rows, marks, title="rank x step grid:"))


def validate_schedule(schedule, layout, num_microbatches: int | None = None) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is valid for ``layout`` (see module doc).

    ``num_microbatches`` is N in micro-batches of --micro-batch-size; when given, the schedule
    must use exactly the instruction micro-batches 0 .. layout.num_schedule_microbatches(N) - 1.
    """
    if len(schedule) != layout.pipeline_size:
        _fail(schedule, f"{len(schedule)} rank lists for pipeline size {layout.pipeline_size}")
    positions = _check_placement_and_uniqueness(schedule, layout)
    _check_completeness(schedule, layout, positions, num_microbatches)
    _check_local_order(schedule, positions)
    _check_in_order(schedule)
    check_satisfiable(schedule, layout.num_stages)


def _check_placement_and_uniqueness(schedule, layout) -> dict:
    positions = {}  # op key -> (rank, step)
    for rank, ops in enumerate(schedule):
        for step, op in enumerate(ops):
            if op.pipeline >= layout.num_pipelines or op.stage >= layout.num_stages:
                _fail(schedule, f"{op} names pipeline {op.pipeline} stage {op.stage}, but the "
                      f"layout has {layout.num_pipelines} pipelines of {layout.num_stages} "
                      f"stages", [(rank, step)])
            host = layout.placement(op.pipeline, op.stage)
            if host != rank:
                _fail(schedule, f"{op} runs on rank {rank} but (pipeline {op.pipeline}, stage "
                      f"{op.stage}) is placed on rank {host}", [(rank, step)])
            if op.chunk != layout.chunk(op.pipeline, op.stage):
                _fail(schedule, f"{op} has chunk {op.chunk}; (pipeline {op.pipeline}, stage "
                      f"{op.stage}) is chunk {layout.chunk(op.pipeline, op.stage)} of rank {rank}",
                      [(rank, step)])
            key = op_key(op)
            if key in positions:
                _fail(schedule, f"{op} appears twice", [positions[key], (rank, step)])
            positions[key] = (rank, step)
    return positions


def _check_completeness(schedule, layout, positions, num_microbatches) -> None:
    by_pipeline = {}
    for kind, pipeline, stage, microbatch in positions:
        if kind is Kind.FORWARD and stage == 0:
            by_pipeline.setdefault(pipeline, set()).add(microbatch)
    owners = Counter(m for microbatches in by_pipeline.values() for m in microbatches)
    shared = sorted(m for m, count in owners.items() if count > 1)
    if shared:
        _fail(schedule, f"micro-batch {shared[0]} is processed by more than one pipeline")
    if num_microbatches is not None:
        expected = set(range(layout.num_schedule_microbatches(num_microbatches)))
        missing, extra = sorted(expected - set(owners)), sorted(set(owners) - expected)
        if missing or extra:
            _fail(schedule, f"expected micro-batches 0..{len(expected) - 1}; missing "
                  f"{missing[:8]}, unexpected {extra[:8]}")
    for pipeline, microbatches in by_pipeline.items():
        for stage in range(layout.num_stages):
            for microbatch in sorted(microbatches):
                forward = (Kind.FORWARD, pipeline, stage, microbatch)
                full = (Kind.BACKWARD, pipeline, stage, microbatch)
                split = [(Kind.BACKWARD_INPUT, pipeline, stage, microbatch),
                         (Kind.BACKWARD_WEIGHT, pipeline, stage, microbatch)]
                name = f"pipeline {pipeline} stage {stage} micro-batch {microbatch}"
                if forward not in positions:
                    _fail(schedule, f"no forward of {name}")
                has_split = [key in positions for key in split]
                if full in positions and any(has_split):
                    _fail(schedule, f"{name} has both a full and a split backward",
                          [positions[full]])
                if full not in positions and not all(has_split):
                    _fail(schedule, f"no backward (B, or I and W) of {name}")
    for key, where in positions.items():
        if key[1] not in by_pipeline or key[3] not in by_pipeline[key[1]]:
            _fail(schedule, f"{schedule[where[0]][where[1]]} has no forward at stage 0", [where])
    counts = [len(by_pipeline.get(p, ())) for p in range(layout.num_pipelines)]
    if max(counts) - min(counts) > 1:
        _fail(schedule, f"micro-batches are not split evenly between pipelines: {counts} "
              f"per pipeline (counts may differ by at most one)")


def _check_local_order(schedule, positions) -> None:
    for rank, ops in enumerate(schedule):
        for step, op in enumerate(ops):
            for key in local_inputs(op):
                where = positions[key]
                if where[1] > step:
                    _fail(schedule, f"{op} runs before {schedule[rank][where[1]]}, which it needs",
                          [(rank, step), where])


def _check_in_order(schedule) -> None:
    for rank, ops in enumerate(schedule):
        last = {}  # (kind class, pipeline, stage) -> (microbatch, step)
        for step, op in enumerate(ops):
            group = (op.kind, op.pipeline, op.stage)
            if group in last and last[group][0] > op.microbatch:
                _fail(schedule, f"(pipeline {op.pipeline}, stage {op.stage}) runs micro-batch "
                      f"{op.microbatch} after {last[group][0]}; each pipeline must process its "
                      f"micro-batches in order", [(rank, last[group][1]), (rank, step)])
            last[group] = (op.microbatch, step)


def check_satisfiable(schedule, num_stages: int) -> None:
    """Execute all ranks in order with messages delivered as soon as produced; a rank may run
    its next instruction once everything it needs has run. Raise if the ranks get stuck."""
    keys = {op_key(op) for ops in schedule for op in ops}
    needs = [[[key for _, key in remote_inputs(op, num_stages, keys)] + local_inputs(op)
              for op in ops] for ops in schedule]
    counters = execute_in_order(schedule, needs)
    done = {op_key(op) for ops, count in zip(schedule, counters) for op in ops[:count]}
    stuck = [(rank, counters[rank]) for rank, ops in enumerate(schedule)
             if counters[rank] < len(ops)]
    if stuck:
        waits = []
        for rank, step in stuck:
            op = schedule[rank][step]
            missing = [key for _, key in remote_inputs(op, num_stages, keys) if key not in done]
            waits.append(f"rank {rank} {op} waits for "
                         + (", ".join(f"{k[0].value}{k[1]}.{k[2]}.{k[3]}" for k in missing)
                            or "a local instruction"))
        _fail(schedule, "cross-rank dependencies cannot be satisfied (circular wait): "
              + "; ".join(waits), stuck)
