"""Tier 0: the performance model takes its schemes from the schedule registry, so interleaved
1F1B is modelled (closed form from its family record, simulator, memory, launch flags)."""

from __future__ import annotations

import shlex

import pytest

from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule
from megatron.performance_model import (
    SCHEMES, HardwareSpec, ModelSpec, StageCosts, closed_form_iteration_time,
    critical_path_counts, evaluate, exposed_allreduce, launch_flags, memory_per_worker,
    num_replicas, search_configurations, simulated_iteration_time, valid_shapes)

TINY = ModelSpec(8, 64, 4, 32, 512)
FLAT = HardwareSpec(1e12, 5e-6, 1e-10, 16e9)


def uniform(forward, backward, p2p, allreduce, num_stages):
    return StageCosts(forward, backward, p2p, (allreduce,) * num_stages, (0,) * num_stages)


def test_every_builtin_family_contributes_schemes():
    assert SCHEMES["interleaved-1f1b"] == ("interleaved-1f1b", {"num_model_chunks": 2})
    assert SCHEMES["chimera-backward-halving"] == ("chimera", {"variant": "backward-halving"})
    assert SCHEMES["1f1b"] == ("1f1b", {}) and SCHEMES["gems"] is None


@pytest.mark.parametrize("depth", [2, 4, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2), (2, 3)])
def test_interleaved_counts_equal_simulated_makespan(depth, units, forward, backward):
    """N v + D - 1 chunk ops each way (Megatron's bubble (D - 1)/v), exact for N = K D."""
    num_microbatches = units * depth
    counts = critical_path_counts("interleaved-1f1b", depth, num_microbatches)
    assert counts == (2 * num_microbatches + depth - 1,) * 2
    _, _, result = simulate_schedule("interleaved-1f1b", depth, num_microbatches, forward,
                                     backward, num_model_chunks=2)
    assert result.makespan == pytest.approx(forward * counts[0] + backward * counts[1])


@pytest.mark.parametrize("depth", [2, 4, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
@pytest.mark.parametrize("forward", [1, 3])
def test_interleaved_closed_form_bounds_the_models_simulation(depth, units, forward):
    """The model simulates the lowered plan with rendezvous p2p (a send completes when its
    receive is posted). For interleaved 1F1B that costs nothing at N = D, and adds waits for
    N > D at some depths (D = 2, N = 4: 31 vs 27 slots), so the closed form is a lower bound,
    exact at N = D."""
    num_microbatches = units * depth
    costs = uniform(forward, 2 * forward, 0, 0, 2 * depth)
    closed = closed_form_iteration_time("interleaved-1f1b", depth, num_microbatches, costs)
    simulated = simulated_iteration_time("interleaved-1f1b", depth, num_microbatches, costs)
    assert closed <= simulated + 1e-9
    if units == 1:
        assert closed == pytest.approx(simulated)


def test_interleaved_is_costed_per_chunk_and_trades_bubble_for_messages():
    depth, num_microbatches = 4, 4
    free_links = HardwareSpec(1e12, 0.0, 0.0, 16e9)
    one = evaluate(TINY, free_links, "1f1b", 1, depth, 1, num_microbatches, "none")
    two = evaluate(TINY, free_links, "interleaved-1f1b", 1, depth, 1, num_microbatches, "none")
    overhead = free_links.op_overhead_seconds
    # A chunk runs half a stage's layers (balanced split of the whole model's FLOPs).
    assert two.costs.forward - overhead == pytest.approx((one.costs.forward - overhead) / 2)
    assert len(two.costs.allreduce) == 2 * depth
    # Free links: 1F1B takes (N + D - 1)(F + B), interleaved (N v + D - 1)(F + B) / v.
    stage_work = one.costs.forward + one.costs.backward
    assert one.simulated_time == pytest.approx((num_microbatches + depth - 1) * stage_work)
    assert two.simulated_time == pytest.approx((2 * num_microbatches + depth - 1)
                                               * stage_work / 2)
    # A 5 us message latency on this tiny model: twice the messages outweigh the bubble.
    assert evaluate(TINY, FLAT, "interleaved-1f1b", 1, depth, 1, num_microbatches,
                    "none").simulated_time > \
        evaluate(TINY, FLAT, "1f1b", 1, depth, 1, num_microbatches, "none").simulated_time


def test_interleaved_exposed_allreduce_sums_the_hosted_chunks():
    costs = StageCosts(1, 2, 0, tuple(float(s + 1) for s in range(8)), (0,) * 8)
    # D = 4, v = 2: rank r hosts virtual stages r and r + 4.
    assert exposed_allreduce("interleaved-1f1b", 4, costs) == [1 + 5, 2 + 6, 3 + 7, 4 + 8]
    assert exposed_allreduce("1f1b", 4, StageCosts(1, 2, 0, (1., 2., 3., 4.), (0,) * 4)) == \
        [1, 2, 3, 4]
    assert num_replicas("interleaved-1f1b", 3) == 3


def test_interleaved_shapes_and_launch_flags_parse():
    from megatron.training.arguments import parse_args

    # 8 layers: D x 2 chunks must divide them, D >= 2 (the family's layout refuses D = 1).
    assert valid_shapes("interleaved-1f1b", 8, 8, 8) == [(4, 2), (2, 4)]
    best = search_configurations(TINY, FLAT, 4, 16, schemes=("interleaved-1f1b",),
                                 recompute_modes=("none",))[0]
    argv = shlex.split(launch_flags(best)) + [
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
        "--vocab-size", "512", "--train-iters", "1", "--lr", "1e-4"]
    config = parse_args(argv, world_size=4)
    assert config.parallel.pipeline_schedule == "interleaved-1f1b"
    assert config.parallel.virtual_pipeline_model_parallel_size == 2
    assert config.parallel.pipeline_model_parallel_size == best.pipeline


def test_memory_counts_chunk_activations():
    one = memory_per_worker(TINY, FLAT, "1f1b", 4, 8, 1, "none")
    two = memory_per_worker(TINY, FLAT, "interleaved-1f1b", 4, 8, 1, "none")
    assert len(two) == 4 and all(value > 0 for value in two)
    # The first rank stores more chunk activations (2(D-1) + (v-1)D + 1 chunks of half a stage
    # = 6.5 stages' worth) than 1F1B's D = 4 stages: interleaving costs activation memory.
    assert two[0] > one[0]
