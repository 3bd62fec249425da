"""Asynchronous point-to-point in the simulator, as the runtime executes it (issue: speed, part 1).

Sends never block; receives are waited for just before the op that consumes them. With free
messages every compute op then starts as soon as its rank is free and its inputs exist, which is
the dependency-only timeline :func:`~megatron.core.pipeline_parallel.planning.lowering.
reference_timeline` computes independently of the simulator; and every schedule stays
deadlock-free.
"""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.planning.lowering import reference_timeline
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.simulator import (simulate, simulate_plan,
                                                                simulate_schedule)


def test_forward_doubling_and_backward_halving_reach_the_non_blocking_timelines():
    # Under the blocking exchange (every send waits for its receive) these were 111 and 223.5.
    _, lowered, result = simulate_schedule("chimera", 8, 32, 1, 2, variant="forward-doubling")
    assert result.makespan == 105
    assert simulate(lowered, 1, 2, p2p_semantics="rendezvous").makespan == 111
    _, lowered, result = simulate_schedule("chimera", 16, 64, 1, 2, variant="backward-halving")
    assert result.makespan == pytest.approx(202.5)
    assert simulate(lowered, 0.5, 1, p2p_semantics="rendezvous").makespan == pytest.approx(223.5)


def _cases():
    for depth in (2, 4, 8, 16, 32):
        counts = sorted({1, depth // 2 or 1, depth - 1 or 1, depth, depth + 1, 2 * depth,
                         4 * depth})
        for count in counts:
            yield "gpipe", depth, count, {}
            yield "1f1b", depth, count, {}
            if depth > 1 and count % depth == 0:
                yield "interleaved-1f1b", depth, count, {"num_model_chunks": 2}
            yield "chimera", depth, count, {}
            if count % depth == 0:
                yield "chimera", depth, count, {"variant": "forward-doubling"}
                yield "chimera", depth, count, {"variant": "backward-halving"}
            if depth >= 4:
                yield "chimera", depth, count, {"num_pipelines": 4}


@pytest.mark.parametrize("depth", [2, 4, 8, 16, 32])
def test_async_simulation_equals_the_dependency_only_timeline(depth):
    for name, d, count, options in _cases():
        if d != depth:
            continue
        plan = make_plan(name, depth, count, options)
        fraction = float(plan.layout.microbatch_fraction)
        result = simulate_plan(plan, 1, 2)  # raises DeadlockError if any rank gets stuck
        times = reference_timeline(plan.schedule, plan.layout.num_stages, fraction, 2 * fraction)
        expected = max(end for rank_times in times for _, end in rank_times)
        assert result.makespan == pytest.approx(expected), (name, depth, count, options)


def test_message_cost_delays_the_consumer_not_the_sender():
    plan = make_plan("1f1b", 2, 1)
    result = simulate_plan(plan, 1, 2, p2p_cost=0.5)
    sender = [(str(entry.op), entry.start, entry.end) for entry in result.timelines[0]]
    assert sender[0] == ("F0.0.0", 0, 1)
    assert sender[1][1:] == (1, 1)  # posting the send takes no time on the sender
    receiver = {str(entry.op): (entry.start, entry.end) for entry in result.timelines[1]}
    assert receiver["F0.1.0"] == (1.5, 2.5)  # waits for the activation's arrival
    assert receiver["B0.1.0"] == (2.5, 4.5)
    backward = {str(entry.op): (entry.start, entry.end) for entry in result.timelines[0]}
    assert backward["B0.0.0"] == (5.0, 7.0)  # the gradient arrives at 4.5 + 0.5
    assert result.makespan == 7
