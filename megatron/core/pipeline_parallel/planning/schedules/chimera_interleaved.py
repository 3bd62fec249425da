"""Interleaved Chimera: two directions, each cut into 2D half-size stages looped over the ranks.

Chimera's two pipelines (down and up) each hold the model in D stages; a rank hosts down stage r and
up stage D-1-r, so the middle ranks get their first input only after D/2 - 1 stage forwards, and
with split backward the makespan is 3N + D/2 - 1 (units: one stage's F = I = W). Cutting each
direction into 2D half-size stages placed in a loop (down stage s on rank ``s mod D``, up stage s
on rank ``D - 1 - (s mod D)``) gives each rank four half stages (the same weights, 2/D of the
model) and halves that start-up: the first half stage of each direction reaches the middle ranks
after (D/2 - 1) half-stage forwards, so the bound becomes 3N + D/4 - 1/2, below the
3N + D/2 - 1/2 of two-chunk single-direction schedules (interleaved zero bubble, ZB-V, DualPipeV).

The order is built by list scheduling (F = 1, B = 2 per half stage): a rank runs, of the ops whose
inputs are there, the one that can start first (backwards before forwards on ties, deeper stages
first), keeping each module's forwards and backwards in micro-batch order and storing at most 2D
half-stage activations (D micro-batches of a 1F1B stage: 1F1B's busiest rank). Micro-batches are
assigned to the directions as in Chimera's basic units. Split backward then places the weight
halves (:mod:`.split_backward`). No torch import.
"""

from __future__ import annotations

from ..instructions import Instruction, backward, forward


def interleaved_chimera_placements(pipeline_size: int) -> tuple[tuple[int, ...], ...]:
    """``placements[pipeline][stage]`` -> rank: down (0) and up (1), 2D stages each."""
    depth = pipeline_size
    down = tuple(stage % depth for stage in range(2 * depth))
    up = tuple(depth - 1 - (stage % depth) for stage in range(2 * depth))
    return down, up


def build_interleaved_chimera(pipeline_size: int, pipeline_microbatches: list[list[int]],
                              forward_cost: float = 1.0,
                              backward_cost: float = 1.0) -> list[list[Instruction]]:
    """Per-rank orders for ``pipeline_microbatches[p]`` (micro-batches of pipeline p, in order);
    see the module docstring."""
    depth = pipeline_size
    num_stages = 2 * depth
    placements = interleaved_chimera_placements(depth)
    hosted = [[] for _ in range(depth)]
    for pipeline, stages in enumerate(placements):
        for stage, rank in enumerate(stages):
            hosted[rank].append((pipeline, stage))
    chunk_of = {module: chunk for modules in hosted for chunk, module in enumerate(modules)}
    limit = 2 * depth
    # Micro-batches in flight per direction (first forward run, first-stage backward not yet):
    # at most D/2, so no rank ever holds more than 2 half stages x D/2 x 2 directions = 2D.
    in_flight = [0, 0]
    max_in_flight = max(1, depth // 2)
    next_forward = {module: 0 for module in chunk_of}
    next_backward = {module: 0 for module in chunk_of}
    forward_end: dict = {}
    backward_end: dict = {}
    free = [0.0] * depth
    stored = [0] * depth
    schedule: list[list[Instruction]] = [[] for _ in range(depth)]
    remaining = 2 * num_stages * sum(len(mbs) for mbs in pipeline_microbatches)

    def candidates(rank):
        for pipeline, stage in hosted[rank]:
            microbatches = pipeline_microbatches[pipeline]
            j = next_backward[(pipeline, stage)]
            if j < next_forward[(pipeline, stage)]:
                m = microbatches[j]
                needs = [forward_end[(pipeline, stage, m)]]
                if stage < num_stages - 1:
                    needs.append(backward_end.get((pipeline, stage + 1, m)))
                if None not in needs:
                    yield max([free[rank]] + needs), 0, -stage, False, (pipeline, stage, m)
            j = next_forward[(pipeline, stage)]
            if (j < len(microbatches) and stored[rank] < limit
                    and (stage > 0 or in_flight[pipeline] < max_in_flight)):
                m = microbatches[j]
                ready = forward_end.get((pipeline, stage - 1, m)) if stage else 0.0
                if ready is not None:
                    yield max(free[rank], ready), 1, -stage, True, (pipeline, stage, m)

    while remaining:
        best = None
        for rank in range(depth):
            for start, order, depth_rank, is_forward, key in candidates(rank):
                choice = (start, order, depth_rank, rank, is_forward, key)
                if best is None or choice[:4] < best[:4]:
                    best = choice
        if best is None:
            raise ValueError(f"interleaved Chimera could not be ordered at D = {depth} within "
                             f"{limit} stored half stages per rank")
        start, _, _, rank, is_forward, (pipeline, stage, m) = best
        module = (pipeline, stage)
        chunk = chunk_of[module]
        if is_forward:
            free[rank] = start + forward_cost
            forward_end[(pipeline, stage, m)] = free[rank]
            next_forward[module] += 1
            stored[rank] += 1
            in_flight[pipeline] += stage == 0
            schedule[rank].append(forward(pipeline, stage, m, chunk))
        else:
            free[rank] = start + backward_cost
            backward_end[(pipeline, stage, m)] = free[rank]
            next_backward[module] += 1
            stored[rank] -= 1
            in_flight[pipeline] -= stage == 0
            schedule[rank].append(backward(pipeline, stage, m, chunk))
        remaining -= 1
    return schedule

