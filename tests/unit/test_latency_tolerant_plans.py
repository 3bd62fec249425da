"""Latency-tolerant plans (planning for a message latency δ > 0 and per-op overheads).

With δ = 0 nothing changes (the free-message plan, what every exactness test runs). With δ > 0
the split planner places weight work knowing that a message arrives δ after its producer (and
fills a wait with a W only when it is long enough) and the lowering sends every message right
after its producer: Chimera + split backward (direct and interleaved) simulated with δ charged
runs faster than the free-message plan, beats PyTorch's best order charged alike, keeps the
per-link send order equal to the receive order, and stores no more than D micro-batches of a
1F1B stage on any rank."""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.planning.instructions import Instruction
from megatron.core.pipeline_parallel.planning.lowering import RECV, SEND, P2PGroup
from megatron.core.pipeline_parallel.planning.op_costs import StageCosts
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.simulator import simulate_plan

LATENCY = 0.05  # 4 ms at 80 ms units
OVERHEAD = (0.015, 0.015, 0.03)  # ~1.2 ms F/I and ~2.3 ms W at 80 ms units


def _costs(variant: str, depth: int) -> StageCosts:
    stages = depth if variant == "direct" else 2 * depth
    return StageCosts(stages, forward=depth / stages, backward=2 * depth / stages)


def _plans(variant: str, depth: int, count: int):
    free = _costs(variant, depth)
    options = {"variant": variant}
    return (make_plan("chimera", depth, count, options, split_backward=0, stage_costs=free),
            make_plan("chimera", depth, count, options, split_backward=0,
                      stage_costs=free.with_overheads(OVERHEAD, LATENCY)), free)


def test_zero_latency_and_overhead_plan_is_the_free_message_plan():
    free = _costs("interleaved", 4)
    default = make_plan("chimera", 4, 8, {"variant": "interleaved"}, split_backward=0,
                        stage_costs=free)
    zero = make_plan("chimera", 4, 8, {"variant": "interleaved"}, split_backward=0,
                     stage_costs=free.with_overheads((0.0, 0.0, 0.0), 0.0))
    assert zero.schedule == default.schedule and zero.lowered == default.lowered


@pytest.mark.parametrize("variant", ["direct", "interleaved"])
@pytest.mark.parametrize("depth,count", [(4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32)])
def test_latency_tolerant_plan_is_faster_with_latency_and_keeps_memory(variant, depth, count):
    today, tolerant, free = _plans(variant, depth, count)
    charged = free.with_overheads(OVERHEAD)
    before = simulate_plan(today, stage_costs=charged, p2p_cost=LATENCY)
    after = simulate_plan(tolerant, stage_costs=charged, p2p_cost=LATENCY)
    assert after.makespan <= before.makespan + 1e-9
    if variant == "interleaved":
        assert after.makespan < 0.98 * before.makespan  # at least 2% faster
    elif count >= 2 * depth:
        assert after.makespan < before.makespan
    scale = depth / tolerant.layout.num_stages
    assert max(after.peak_activations) * scale <= depth  # 1F1B's busiest rank


def test_overheads_are_charged_per_op_and_a_first_stage_free_input_half_costs_nothing():
    from megatron.core.pipeline_parallel.planning.instructions import Kind
    costs = StageCosts(4, 1.0, 2.0).with_overheads((0.1, 0.2, 0.3), 0.05)
    assert costs.cost(Instruction(Kind.FORWARD, 0, 1, 0)) == pytest.approx(1.1)
    assert costs.cost(Instruction(Kind.BACKWARD_INPUT, 0, 1, 0)) == pytest.approx(1.2)
    assert costs.cost(Instruction(Kind.BACKWARD_WEIGHT, 0, 1, 0)) == pytest.approx(1.3)
    assert costs.cost(Instruction(Kind.BACKWARD, 0, 1, 0)) == pytest.approx(2.5)
    assert costs.cost(Instruction(Kind.BACKWARD_INPUT, 0, 0, 0)) == 0.0
    assert costs.cost(Instruction(Kind.BACKWARD_WEIGHT, 0, 0, 0)) == pytest.approx(2.3)
    assert costs.scaled(0.5).op_overhead == (0.1, 0.2, 0.3)  # per op, not per sample
    assert costs.ideal_compute() == StageCosts(4, 1.0, 2.0).ideal_compute()
    with pytest.raises(ValueError, match="op_overhead"):
        StageCosts(4).with_overheads((0.1, -1.0, 0.0))
    with pytest.raises(ValueError, match="message_latency"):
        StageCosts(4).with_overheads((0.0, 0.0, 0.0), -0.1)


@pytest.mark.parametrize("variant", ["direct", "interleaved"])
def test_eager_sends_keep_link_order_and_never_send_later(variant):
    today, tolerant, _ = _plans(variant, 4, 8)
    for plan in (today, tolerant):
        for sender, ops in enumerate(plan.lowered):
            for receiver in range(len(plan.lowered)):
                sent = [p2p.message for op in ops if isinstance(op, P2PGroup)
                        for p2p in op.ops if p2p.direction == SEND and p2p.peer == receiver]
                received = [p2p.message for op in plan.lowered[receiver]
                            if isinstance(op, P2PGroup) for p2p in op.ops
                            if p2p.direction == RECV and p2p.peer == sender]
                assert sent == received, (sender, receiver)
    # The same order lowered both ways: no message is sent later than by the default rule,
    # and some are sent earlier.
    from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
    costs = tolerant.stage_costs
    default, eager = (send_points(lower_schedule(tolerant.schedule, tolerant.layout,
                                                 stage_costs=costs, eager_sends=flag))
                      for flag in (False, True))
    assert default.keys() == eager.keys()
    assert all(eager[message] <= default[message] for message in default)
    assert any(eager[message] < default[message] for message in default)


def send_points(lowered) -> dict:
    """message -> compute ops its sender runs before sending it."""
    points = {}
    for ops in lowered:
        done = 0
        for op in ops:
            if isinstance(op, Instruction):
                done += 1
            elif isinstance(op, P2PGroup):
                points.update({p2p.message: done for p2p in op.ops if p2p.direction == SEND})
    return points


def test_op_costs_file_carries_latency_and_overheads(tmp_path):
    import json

    from megatron.core.pipeline_parallel.planning.op_cost_profile import load_stage_costs
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"stages": [[1, 1, 1]] * 4, "message_latency": 0.004,
                                "op_overhead": [0.001, 0.001, 0.002]}))
    costs = load_stage_costs(str(path), 4, 4)
    assert costs.message_latency == 0.004 and costs.op_overhead == (0.001, 0.001, 0.002)
    path.write_text(json.dumps({"stages": [[1, 1, 1]] * 4, "op_overhead": [0.1]}))
    with pytest.raises(ValueError, match="op_overhead"):
        load_stage_costs(str(path), 4, 4)


@pytest.mark.parametrize("variant", ["direct", "interleaved"])
def test_planner_and_simulator_agree_with_latency_and_overheads(variant):
    """With eager sends, the placement's own estimate is the simulated makespan."""
    from megatron.core.pipeline_parallel.planning.schedules import build_schedule
    from megatron.core.pipeline_parallel.planning.schedules.split_backward import (
        split_backward_placement)
    _, tolerant, free = _plans(variant, 8, 16)
    costs = free.with_overheads(OVERHEAD, LATENCY)
    _, planned = split_backward_placement(build_schedule("chimera", 8, 16, variant=variant),
                                          tolerant.layout.num_stages, 0, costs)
    simulated = simulate_plan(tolerant, stage_costs=costs, p2p_cost=LATENCY).makespan
    assert simulated == pytest.approx(planned)


@pytest.mark.parametrize("name,options,split", [("interleaved-1f1b", {"num_model_chunks": 2}, None),
                                                ("1f1b", {}, 0),
                                                ("chimera", {"variant": "direct"}, 0),
                                                ("chimera", {"variant": "interleaved"}, 0)])
def test_eager_sends_on_a_free_plan_keep_order_and_makespan(name, options, split):
    """What the runtime plans where sends complete in the background (gloo): the free plan's
    compute order and simulated makespan, every send right after its producer (or with the
    round's later messages to the same peer), never later than the round rule."""
    default = make_plan(name, 4, 8, options, split_backward=split)
    eager = make_plan(name, 4, 8, options, split_backward=split, eager_sends=True)
    assert make_plan(name, 4, 8, options, split_backward=split, eager_sends=None).lowered == \
        default.lowered  # None: eager only for latency plans, as before
    assert eager.schedule == default.schedule and eager.lowered != default.lowered
    assert simulate_plan(eager).makespan == pytest.approx(simulate_plan(default).makespan)
    before, after = send_points(default.lowered), send_points(eager.lowered)
    assert before.keys() == after.keys()
    assert all(after[message] <= before[message] for message in before)
    assert any(after[message] < before[message] for message in before)
