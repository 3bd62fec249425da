"""Tier 0: each term the performance model added for the paper's comparison, against a
hand-computed case or the simulator; the baselines; the planner's launch flags."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule
from megatron.performance_model import (
    GPT2_PAPER, HardwareSpec, ModelSpec, StageCosts, baseline_memory, critical_path_counts,
    evaluate, gems_time, launch_flags, memory_per_worker, pipedream_2bw_time, pipedream_time,
    search_configurations, shared_link_finish_times, simulated_iteration_time,
    stage_parameters, state_bytes, total_parameters)

TINY = ModelSpec(8, 64, 4, 32, 512)
FLAT = HardwareSpec(1e12, 5e-6, 1e-10, 16e9)


def uniform(forward, backward, p2p, allreduce, num_stages):
    return StageCosts(forward, backward, p2p, (allreduce,) * num_stages, (0,) * num_stages)


def test_paper_model_has_the_papers_parameter_count():
    assert total_parameters(GPT2_PAPER) == 1_389_327_360  # chimera.md §8 (1,024 positions)


def test_compute_rate_saturates_with_micro_batch_tokens():
    hardware = HardwareSpec(1e12, 0, 0, 1e9, half_efficiency_tokens=64)
    assert hardware.sustained_rate(64) == pytest.approx(0.5e12)
    assert hardware.sustained_rate(192) == pytest.approx(0.75e12)
    assert FLAT.sustained_rate(1) == FLAT.flops_per_second
    with pytest.raises(ValueError, match="at least one token"):
        hardware.sustained_rate(0)
    # Per sample, larger micro-batches run faster (TINY: s = 32 tokens per sample).
    per_sample = [evaluate(TINY, hardware, "1f1b", 1, 2, b, 32 // b, False).costs.forward / b
                  for b in (1, 2, 4, 8)]
    assert per_sample == sorted(per_sample, reverse=True)
    assert per_sample[0] / per_sample[1] == pytest.approx((32 + 64) / 32 / ((64 + 64) / 64))


def test_shared_link_hand_cases():
    assert shared_link_finish_times([(0, 2), (0, 3)]) == pytest.approx([4, 5])
    assert shared_link_finish_times([(0, 2), (1, 1)]) == pytest.approx([3, 3])
    assert shared_link_finish_times([(0, 1), (5, 1)]) == pytest.approx([1, 6])
    assert shared_link_finish_times([(2, 0), (0, 1)]) == pytest.approx([2, 1])


def test_sync_policies_differ_once_syncs_share_the_link():
    depth, num_microbatches = 8, 16
    costs = uniform(1, 2, 0, 4.0, depth)
    times = {policy: simulated_iteration_time("chimera-direct", depth, num_microbatches, costs,
                                              policy) for policy in ("end", "eager", "eager-opt")}
    compute = simulated_iteration_time("chimera-direct", depth, num_microbatches,
                                       uniform(1, 2, 0, 0, depth))
    assert times["end"] == pytest.approx(compute + 8.0)  # two stages' syncs in sequence
    assert times["eager"] < times["end"] and times["eager-opt"] < times["end"]


@pytest.mark.parametrize("depth,pipelines", [(4, 4), (8, 4), (8, 8)])
def test_two_f_pipelines_counts_match_the_simulator(depth, pipelines):
    scheme = f"chimera-direct-{pipelines}p"
    forward_count, backward_count = critical_path_counts(scheme, depth, depth)
    _, _, result = simulate_schedule("chimera", depth, depth, 1, 2, num_pipelines=pipelines)
    assert result.makespan == pytest.approx(forward_count + 2 * backward_count)
    assert simulated_iteration_time(scheme, depth, depth, uniform(1, 2, 0, 0, depth)) == \
        pytest.approx(result.makespan)


def test_backward_halving_is_forward_doubling_on_half_micro_batches():
    halving = evaluate(TINY, FLAT, "chimera-backward-halving", 1, 4, 2, 4, False)
    doubling = evaluate(TINY, FLAT, "chimera-forward-doubling", 1, 4, 1, 8, False)
    assert halving.simulated_time == pytest.approx(doubling.simulated_time)
    assert halving.global_batch_size == doubling.global_batch_size == 8
    with pytest.raises(ValueError, match="even micro-batch size"):
        evaluate(TINY, FLAT, "chimera-backward-halving", 1, 4, 1, 8, False)


def test_baseline_times_hand_cases():
    costs = StageCosts(1.0, 2.0, 0.5, (3.0,) * 4, (0,) * 4)
    free = StageCosts(1.0, 2.0, 0.0, (0.0,) * 8, (0,) * 8)
    # GEMS step replayed from the authors' loop = Table 2's bubble ratio (D−1)/(D+1/2):
    # 2(F + Bk) of work per worker per step, so a step lasts 2·3·(D + 1/2)/(3/2) = 34 at D=8.
    assert gems_time(8, 2, free) == pytest.approx(34.0)
    assert gems_time(8, 4, free) == pytest.approx(68.0)
    # ... and both hosted stages' syncs add at the end (shared link): 2 × 3.
    assert gems_time(4, 8, costs) - gems_time(4, 8, dataclasses.replace(
        costs, allreduce=(0.0,) * 4)) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="N must be even"):
        gems_time(4, 3, costs)
    # No sync: 1F1B without a flush has no bubble: N(F + Bk + 2p) for PipeDream and 2BW.
    no_sync = dataclasses.replace(costs, allreduce=(0.0,) * 4)
    assert pipedream_2bw_time(4, 8, no_sync) == pytest.approx(8 * 4)
    assert pipedream_time(4, 8, no_sync) == pytest.approx(8 * 4)
    # PipeDream syncs every micro-batch, 2BW once per N: PipeDream pays at least N syncs
    # beyond the compute, 2BW at least one (a blocked rank delays its neighbours' gradients).
    assert pipedream_time(4, 8, costs) >= 8 * 4 + 8 * (3.0 - 2.0)
    assert 8 * 4 + 3.0 - 2.0 <= pipedream_2bw_time(4, 8, costs) < pipedream_time(4, 8, costs)


def test_baseline_memory_weight_versions_and_stages():
    pipedream = baseline_memory(TINY, FLAT, "pipedream", 4, 1, "none", 1)
    two_bw = baseline_memory(TINY, FLAT, "pipedream-2bw", 4, 1, "none", 1)
    gems = baseline_memory(TINY, FLAT, "gems", 4, 1, "none", 1)
    one_f_one_b = memory_per_worker(TINY, FLAT, "1f1b", 4, 4, 1, "none")
    assert pipedream[0] - one_f_one_b[0] == pytest.approx(
        3 * stage_parameters(TINY, 4, 0) * TINY.bytes_per_value)  # D − 0 = 4 versions
    assert two_bw[1] - one_f_one_b[1] == pytest.approx(
        stage_parameters(TINY, 4, 1) * TINY.bytes_per_value)
    assert gems[1] > 16 * (stage_parameters(TINY, 4, 1) + stage_parameters(TINY, 4, 2))


def test_distributed_optimizer_shards_optimizer_state():
    plain = state_bytes(TINY, FLAT, 4, [0, 3], replicas=8)
    sharded = state_bytes(TINY, FLAT, 4, [0, 3], replicas=8, distributed_optimizer=True)
    params = stage_parameters(TINY, 4, 0) + stage_parameters(TINY, 4, 3)
    assert plain - sharded == pytest.approx(params * 8 * (1 - 1 / 8))


def test_framework_overhead_is_added_to_every_worker():
    with_overhead = HardwareSpec(1e12, 5e-6, 1e-10, 16e9, framework_overhead_bytes=1e9)
    base = memory_per_worker(TINY, FLAT, "chimera-direct", 4, 4, 1, "none")
    more = memory_per_worker(TINY, with_overhead, "chimera-direct", 4, 4, 1, "none")
    assert [b - a for a, b in zip(base, more)] == pytest.approx([1e9] * 4)


def test_best_configurations_launch_flags_parse():
    from megatron.training.arguments import parse_args

    best = search_configurations(TINY, FLAT, 8, 32, schemes=("chimera-direct", "1f1b"),
                                 recompute_modes=("none", "selective", "full"))[0]
    argv = shlex.split(launch_flags(best)) + [
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
        "--vocab-size", "512", "--train-iters", "1", "--lr", "1e-4"]
    config = parse_args(argv, world_size=8)
    assert config.parallel.pipeline_model_parallel_size == best.pipeline
    assert config.training.global_batch_size == 32
    assert "modelled only" in launch_flags(
        evaluate(TINY, FLAT, "pipedream", 2, 4, 1, 4, False))


def test_op_overhead_is_paid_once_per_forward_and_backward():
    slow = HardwareSpec(1e12, 5e-6, 1e-10, 16e9, op_overhead_seconds=0.01)
    base = evaluate(TINY, FLAT, "1f1b", 1, 4, 1, 4, "full").costs
    more = evaluate(TINY, slow, "1f1b", 1, 4, 1, 4, "full").costs
    assert more.forward - base.forward == pytest.approx(0.01)
    assert more.backward - base.backward == pytest.approx(0.01)


@pytest.mark.distributed  # starts a process
def test_cli_prints_the_best_runnable_configurations_flags():
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "performance_model.py"
    output = subprocess.run(
        [sys.executable, str(tool), "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "512",
         "--world-size", "8", "--global-batch-size", "32", "--schemes", "all",
         "--recompute", "selective", "--top", "3"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    flags = output.splitlines()[-1]
    assert flags.startswith("pretrain_gpt.py flags of the best fitting runnable configuration")
    assert "--pipeline-model-parallel-size" in flags and "--recompute-granularity selective" in flags


def test_uneven_stages_cost_their_own_layers():
    """stage_layer_counts (Megatron's --decoder-first/last-pipeline-num-layers): each stage's
    parameters, forward time and stored activations follow its own layer count."""
    from megatron.core.pipeline_parallel.planning.stage_split import StageSplit, stage_layer_counts
    from megatron.performance_model.costs import (layer_parameters, stage_compute_times,
                                                  stage_layers)
    counts = stage_layer_counts(8, 4, 4, StageSplit(first=1, last=1))
    assert counts == (1, 3, 3, 1)
    uneven = dataclasses.replace(TINY, stage_layer_counts=counts)
    assert [stage_layers(uneven, 4, stage) for stage in range(4)] == [1, 3, 3, 1]
    assert stage_parameters(uneven, 4, 1) == 3 * layer_parameters(TINY)
    assert stage_parameters(uneven, 4, 1) - stage_parameters(TINY, 4, 1) == layer_parameters(TINY)
    assert sum(stage_parameters(uneven, 4, s) for s in range(4)) == total_parameters(TINY)
    forward, _ = stage_compute_times(uneven, FLAT, 4, 1, "none")
    even_forward, _ = stage_compute_times(TINY, FLAT, 4, 1, "none")
    assert forward[1] == pytest.approx(1.5 * even_forward[1])  # 3 layers instead of 2
    memory = memory_per_worker(uneven, FLAT, "1f1b", 4, 4, 1, "none")
    even = memory_per_worker(TINY, FLAT, "1f1b", 4, 4, 1, "none")
    assert memory[1] > even[1] and memory[0] < even[0]
    with pytest.raises(ValueError, match=r"must give the layers of each of the 4 model stages"):
        stage_parameters(dataclasses.replace(TINY, stage_layer_counts=(1, 3, 3)), 4, 0)
