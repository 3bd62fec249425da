"""Split backward in planning: the schedules are valid; 1F1B with split backward is ZB-H1 (makespan
3N + D - 1 with F = I = W, at 1F1B's peak memory); Chimera with split backward takes 3N + D/2 - 1 at
Chimera's peak memory and so beats Chimera direct, forward doubling and ZB-H1 at every D in
{4, 8, 16, 32}, N in {D, 2D, 4D} (B = 2F split evenly)."""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.planning.instructions import Kind
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout
from megatron.core.pipeline_parallel.planning.schedules.split_backward import (
    split_backward_schedule)
from megatron.core.pipeline_parallel.planning.simulator import simulate_plan


def makespan_and_peak(name, depth, count, options=None, split=None):
    result = simulate_plan(make_plan(name, depth, count, options, split_backward=split), 1, 2)
    return result.makespan, max(result.peak_activations)


@pytest.mark.parametrize("depth", [4, 8, 16, 32])
def test_chimera_with_split_backward_beats_every_baseline(depth):
    for count in (depth, 2 * depth, 4 * depth):
        split, split_peak = makespan_and_peak("chimera", depth, count, split=0)
        direct, direct_peak = makespan_and_peak("chimera", depth, count)
        doubling, _ = makespan_and_peak("chimera", depth, count, {"variant": "forward-doubling"})
        zb_h1, zb_h1_peak = makespan_and_peak("1f1b", depth, count, split=0)
        assert zb_h1 == 3 * count + depth - 1 and zb_h1_peak == depth  # ZB-H1 (Qi et al.)
        assert split == 3 * count + depth // 2 - 1
        assert split < min(direct, doubling, zb_h1), (depth, count)
        assert split_peak == direct_peak


def test_every_backward_is_split_and_weights_follow_their_input_half():
    layout = schedule_layout("chimera", 4)
    schedule = split_backward_schedule(build_schedule("chimera", 4, 8), layout.num_stages, 1)
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
