"""Data dependencies between compute instructions of a pipeline schedule.

Owns the one definition, shared by the validator, the lowering pass and the simulator, of which
instruction needs which: a forward of stage s > 0 needs the activation produced by the forward
of stage s - 1 (same pipeline and micro-batch); a backward (or input-gradient backward) of a
stage below the last needs the gradient produced by the backward of stage s + 1; every backward
needs its own forward, and a weight-gradient backward its input-gradient backward, on the same
rank. Instructions are identified by ``(kind, pipeline, stage, microbatch)``; chunk is derived.
It also owns which instructions store and release an activation (:func:`peak_activations`).
No torch import.
"""

from __future__ import annotations

from .instructions import Instruction, Kind

ACTIVATION = "activation"
GRADIENT = "gradient"


def op_key(op: Instruction) -> tuple:
    """Identity of a compute instruction inside a schedule (independent of its chunk)."""
    return (op.kind, op.pipeline, op.stage, op.microbatch)


def _producer_of_gradient(schedule_keys, pipeline: int, stage: int, microbatch: int) -> tuple:
    """The downstream op that produces the input gradient: B, or I when the backward is split."""
    full = (Kind.BACKWARD, pipeline, stage, microbatch)
    if schedule_keys is None or full in schedule_keys:
        return full
    return (Kind.BACKWARD_INPUT, pipeline, stage, microbatch)


def remote_inputs(op: Instruction, num_stages: int, schedule_keys=None) -> list[tuple[str, tuple]]:
    """Cross-stage inputs of ``op``: ``[(message kind, producer key)]``.

    The first stage reads its input from the data and the last stage starts its backward from
    the loss, so neither receives anything for those.
    """
    if op.kind is Kind.FORWARD:
        if op.stage == 0:
            return []
        return [(ACTIVATION, (Kind.FORWARD, op.pipeline, op.stage - 1, op.microbatch))]
    if op.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        if op.stage == num_stages - 1:
            return []
        return [(GRADIENT, _producer_of_gradient(schedule_keys, op.pipeline, op.stage + 1,
                                                 op.microbatch))]
    return []  # BACKWARD_WEIGHT needs nothing from other stages


def local_inputs(op: Instruction) -> list[tuple]:
    """Same-rank inputs of ``op`` (keys of instructions that must run earlier on its rank)."""
    if op.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
        return [(Kind.FORWARD, op.pipeline, op.stage, op.microbatch)]
    if op.kind is Kind.BACKWARD_WEIGHT:
        return [(Kind.BACKWARD_INPUT, op.pipeline, op.stage, op.microbatch)]
    return []


def execute_in_order(schedule, needs, on_run=None) -> list[int]:
    """Run every rank's instructions in order, each once all keys in ``needs[rank][index]`` ran.

    Messages are taken as delivered the moment they are produced. ``on_run(rank, index)`` is called
    for each instruction as it runs (before it counts as done). Returns, per rank, how many of its
    instructions ran: fewer than its list's length means the ranks got stuck there.
    """
    done = set()
    counters = [0] * len(schedule)
    progress = True
    while progress:
        progress = False
        for rank, ops in enumerate(schedule):
            while counters[rank] < len(ops):
                index = counters[rank]
                if not all(key in done for key in needs[rank][index]):
                    break
                if on_run is not None:
                    on_run(rank, index)
                done.add(op_key(ops[index]))
                counters[rank] += 1
                progress = True
    return counters


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
