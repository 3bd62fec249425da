"""Split backward in planning: the schedules are valid; 1F1B with split backward is ZB-H1 (makespan
3N + D - 1 with F = I = W, at 1F1B's peak memory); Chimera with split backward takes 3N + D/2 - 1 at
Chimera's peak memory and so beats Chimera direct, forward doubling and ZB-H1 at every D in
{4, 8, 16, 32}, N in {D, 2D, 4D} (B = 2F split evenly), both with every stage charged I = W and
charged as the runtime runs (a first stage's I free, its whole backward in W); with 2f pipelines
3N + D/(2f) - 1. The planner and the simulator charge the same."""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.planning.instructions import Kind
from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
from megatron.core.pipeline_parallel.planning.op_costs import StageCosts
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout
from megatron.core.pipeline_parallel.planning.schedules.split_backward import (
    split_backward_placement, split_backward_schedule)
from megatron.core.pipeline_parallel.planning.simulator import simulate, simulate_plan


def makespan_and_peak(name, depth, count, options=None, split=None, uniform_split=False):
    costs = StageCosts(depth, uniform_split=True) if uniform_split else None
    plan = make_plan(name, depth, count, options, split_backward=split, stage_costs=costs)
    result = simulate_plan(plan, 1, 2, stage_costs=costs)
    return result.makespan, max(result.peak_activations)


@pytest.mark.parametrize("uniform_split", [True, False], ids=["I=W-everywhere", "as-run"])
@pytest.mark.parametrize("depth", [4, 8, 16, 32])
def test_chimera_with_split_backward_beats_every_baseline(depth, uniform_split):
    def measure(name, options=None, split=None):
        return makespan_and_peak(name, depth, count, options, split, uniform_split)

    for count in (depth, 2 * depth, 4 * depth):
        split, split_peak = measure("chimera", split=0)
        direct, direct_peak = measure("chimera")
        doubling, _ = measure("chimera", {"variant": "forward-doubling"})
        zb_h1, zb_h1_peak = measure("1f1b", split=0)
        assert zb_h1 == 3 * count + depth - 1 and zb_h1_peak == depth  # ZB-H1 (Qi et al.)
        assert split == 3 * count + depth // 2 - 1
        assert split < min(direct, doubling, zb_h1), (depth, count)
        assert split_peak == direct_peak


def test_every_backward_is_split_and_weights_follow_their_input_half():
    layout = schedule_layout("chimera", 4)
    kept = split_backward_schedule(build_schedule("chimera", 4, 8), layout.num_stages, 1,
                                   defer_first_stage=False)
    for ops in kept:  # first stages' backwards whole, every other one split
        assert all((op.kind is Kind.BACKWARD) == (op.stage == 0) for op in ops
                   if op.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT))
    schedule = split_backward_schedule(build_schedule("chimera", 4, 8), layout.num_stages, 1,
                                       defer_first_stage=True)
    for ops in schedule:
        kinds = [op.kind for op in ops]
        assert Kind.BACKWARD not in kinds
        assert kinds.count(Kind.BACKWARD_INPUT) == kinds.count(Kind.BACKWARD_WEIGHT)
        seen = set()
        for op in ops:
            if op.kind is Kind.BACKWARD_INPUT:
                seen.add(op.module + (op.microbatch,))
            elif op.kind is Kind.BACKWARD_WEIGHT:
                assert op.module + (op.microbatch,) in seen, op


def test_the_memory_bound_limits_deferred_weight_work():
    for extra in (0, 1, 3):
        _, peak = makespan_and_peak("1f1b", 4, 16, split=extra)
        assert peak <= 4 + extra
    with pytest.raises(ValueError, match="must be >= 0"):
        split_backward_schedule(build_schedule("1f1b", 2, 2), 2, -1)


def test_gradient_sync_follows_the_last_weight_op_of_each_module():
    plan = make_plan("chimera", 4, 4, split_backward=1, grad_sync_policy="eager")
    for ops in plan.lowered:
        for index, op in enumerate(ops):
            if type(op).__name__ == "GradSyncStart":
                later = [o for o in ops[index:] if getattr(o, "kind", None) is Kind.BACKWARD_WEIGHT
                         and o.module == (op.pipeline, op.stage)]
                assert not later, (op, later)


@pytest.mark.parametrize("depth", [8, 16, 32])
def test_more_pipelines_with_split_backward_take_3n_plus_d_over_p_minus_1(depth):
    for pipelines in (4, 8):
        for count in (depth, 2 * depth, 4 * depth):
            makespan, peak = makespan_and_peak("chimera", depth, count,
                                               {"num_pipelines": pipelines}, split=0)
            assert makespan == 3 * count + depth // pipelines - 1, (pipelines, count)
            assert peak <= depth


def test_simulator_charges_a_first_stage_its_whole_backward_in_the_weight_half():
    plan = make_plan("1f1b", 4, 4, split_backward=0)
    durations = {}
    for entries in simulate_plan(plan, 1, 2).compute_timelines():
        for entry in entries:
            durations.setdefault((entry.op.kind, entry.op.stage), set()).add(
                entry.end - entry.start)
    assert durations[(Kind.FORWARD, 0)] == {1}
    for stage in (1, 2, 3):
        assert durations[(Kind.BACKWARD_INPUT, stage)] == {1}
        assert durations[(Kind.BACKWARD_WEIGHT, stage)] == {1}
    first = {kind: durations.get((kind, 0)) for kind in Kind}
    assert first[Kind.BACKWARD] == {2} or (first[Kind.BACKWARD_INPUT] == {0}
                                           and first[Kind.BACKWARD_WEIGHT] == {2}), first


def test_stage_costs_first_and_last_stage_and_profile():
    costs = StageCosts(4, forward=1, backward=3, input_share=1 / 3, loss_cost=0.5,
                       per_stage={2: (2, 1, 4)})
    assert costs.forward_input_weight(0) == (1, 0, 3)
    assert costs.forward_input_weight(1) == (1, 1, 2)
    assert costs.forward_input_weight(2) == (2, 1, 4)
    assert costs.forward_input_weight(3) == (1.5, 1, 2)
    assert costs.scaled(0.5).forward_input_weight(2) == (1, 0.5, 2)
    assert StageCosts(4, uniform_split=True).forward_input_weight(0) == (1, 1, 1)
    for bad in ({"input_share": 2}, {"forward": -1}, {"per_stage": {4: (1, 1, 1)}}):
        with pytest.raises(ValueError):
            StageCosts(4, **bad)


def test_deferring_first_stages_planned_with_uniform_charges_runs_slower_than_planned():
    """The miss of issue 26: placed as if a first stage's I and W were equal, Chimera + split runs
    slower than planned once the first stage's backward is charged where it really runs."""
    depth, count = 8, 16
    layout = schedule_layout("chimera", depth)
    uniform = StageCosts(depth, uniform_split=True)
    schedule = split_backward_schedule(build_schedule("chimera", depth, count), depth, 0,
                                       uniform, defer_first_stage=True)
    lowered = lower_schedule(schedule, layout, "eager-opt", 1, 2)
    planned = simulate(lowered, p2p_semantics="async", stage_costs=uniform).makespan
    as_run = simulate(lowered, p2p_semantics="async").makespan
    assert planned == 3 * count + depth // 2 - 1
    assert as_run > planned
    best = simulate_plan(make_plan("chimera", depth, count, split_backward=0)).makespan
    assert best == planned  # charged as run, the planner keeps the first stages' backward whole


@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("name,options", [("1f1b", None), ("chimera", None),
                                          ("chimera", {"num_pipelines": 4}),
                                          ("interleaved-1f1b", {"num_model_chunks": 2})])
def test_planner_and_simulator_charge_the_same(name, options, defer):
    layout = schedule_layout(name, 8, **(options or {}))
    costs = StageCosts(layout.num_stages, forward=1.0, backward=2.5, input_share=0.4,
                       loss_cost=0.3, per_stage={1: (1.2, 0.9, 1.4)})
    schedule, planned = split_backward_placement(build_schedule(name, 8, 16, **(options or {})),
                                                 layout.num_stages, 0, costs, defer)
    lowered = lower_schedule(schedule, layout, "eager-opt", stage_costs=costs)
    simulated = simulate(lowered, p2p_semantics="async", stage_costs=costs).makespan
    assert simulated == pytest.approx(planned)


@pytest.mark.parametrize("depth", [4, 8, 16])
def test_interleaved_chimera_with_split_backward_takes_3n_plus_d_over_4_minus_half(depth):
    """Two directions of 2D half-size looped stages: the middle ranks' first input arrives after
    D/2 - 1 half-stage forwards, so 3N + D/4 - 1/2 (one stage's F = I = W = 1), below the
    3N + D/2 - 1/2 of PyTorch's two-chunk zero-bubble schedules, at D stored micro-batches of a
    1F1B stage and Chimera's weights (four half stages per rank)."""
    for count in (depth, 2 * depth, 4 * depth):
        plan = make_plan("chimera", depth, count, {"variant": "interleaved"}, split_backward=0,
                         stage_costs=StageCosts(2 * depth, 0.5, 1.0))
        assert plan.layout.num_stages == 2 * depth
        assert all(len(plan.layout.hosted(rank)) == 4 for rank in range(depth))
        result = simulate_plan(plan, stage_costs=StageCosts(2 * depth, 0.5, 1.0))
        assert result.makespan == pytest.approx(3 * count + depth / 4 - 0.5), (depth, count)
        assert max(result.peak_activations) <= 2 * depth  # half stages: D 1F1B-stage micro-batches
        assert result.makespan < makespan_and_peak("chimera", depth, count, split=0)[0]
