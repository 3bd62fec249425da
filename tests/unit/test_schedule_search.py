"""The schedule search: every variant simulated with the same charges; the fastest within the
memory budget (activations of 1F1B's busiest rank, weight copies) is interleaved Chimera + split
backward, 3N + D/4 - 1/2, ahead of Chimera direct + split (3N + D/2 - 1 with two pipelines) and of
ZB-H1 (3N + D - 1)."""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.planning.op_costs import StageCosts
from megatron.core.pipeline_parallel.planning.schedule_search import (best_schedule,
                                                                      search_schedules)


@pytest.mark.parametrize("depth", [4, 8])
def test_interleaved_chimera_with_split_backward_is_the_fastest_fitting_variant(depth):
    for count in (depth, 2 * depth, 4 * depth):
        best = best_schedule(depth, count)
        assert (best.name, best.options, best.split_backward) == (
            "chimera", {"num_pipelines": 2, "variant": "interleaved"}, 0)
        assert best.makespan == pytest.approx(3 * count + depth / 4 - 0.5)
        assert best.peak_activations <= depth and best.weight_copies == 2
        by_name = {c.describe(): c for c in search_schedules(depth, count)}
        assert by_name["1f1b + split backward"].makespan == 3 * count + depth - 1
        assert by_name["chimera (num_pipelines=2, variant=direct) + split backward"].makespan == (
            3 * count + depth // 2 - 1)


def test_a_larger_weight_budget_admits_four_pipelines():
    best = best_schedule(8, 8, max_weight_copies=4)
    assert best.options["num_pipelines"] == 4 and best.makespan == 3 * 8 + 8 // 4 - 1
    unfit = [c for c in search_schedules(8, 8) if not c.fits]
    assert unfit and all(c.weight_copies > 2 or c.peak_activations > 8 for c in unfit)


def test_search_uses_the_given_stage_costs_and_rejects_an_impossible_budget():
    heavy_first = lambda stages: StageCosts(stages, per_stage={0: (2.0, 2.0, 2.0)})  # noqa: E731
    assert best_schedule(4, 8, stage_costs=heavy_first).makespan > best_schedule(4, 8).makespan
    with pytest.raises(ValueError, match="no schedule variant fits"):
        best_schedule(4, 4, max_activations=1)


def test_with_a_message_latency_every_candidate_is_planned_latency_tolerant():
    from megatron.core.pipeline_parallel.planning.plan import make_plan
    from megatron.core.pipeline_parallel.planning.simulator import simulate_plan
    latency = 0.05
    best = best_schedule(8, 16, p2p_cost=latency)
    assert (best.name, best.options["variant"], best.split_backward) == (
        "chimera", "interleaved", 0)
    costs = StageCosts(16, 0.5, 1.0)
    free_plan = make_plan("chimera", 8, 16, {"variant": "interleaved"}, split_backward=0,
                          stage_costs=costs)
    free_plan_with_latency = simulate_plan(free_plan, stage_costs=costs, p2p_cost=latency)
    assert best.makespan < 0.97 * free_plan_with_latency.makespan
    assert best.peak_activations <= 8
