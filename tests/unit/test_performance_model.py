"""Tier 0: the performance model (closed form vs simulator, formulas, memory, search, CLI)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from megatron.performance_model import (
    HardwareSpec, ModelSpec, StageCosts, allreduce_time, closed_form_iteration_time,
    compare_schemes, critical_path_counts, evaluate, layer_forward_flops, memory_per_worker,
    num_replicas, peak_stored_microbatches, search_configurations, simulated_iteration_time,
    total_parameters, valid_shapes)
from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOOL = os.path.join(ROOT, "tools", "performance_model.py")

GPT2 = ModelSpec(64, 1280, 20, 632, 50257, max_position_embeddings=1024)
TINY = ModelSpec(8, 64, 4, 32, 512)
P100 = HardwareSpec(9.3e12 * 0.3, 5e-6, 1e-10, 16e9)


def uniform(forward, backward, p2p, allreduce, num_stages):
    return StageCosts(forward, backward, p2p, (allreduce,) * num_stages, (0,) * num_stages)


# ----------------------------------------------------------------------------- closed form


@pytest.mark.parametrize("depth", [2, 4, 8])
@pytest.mark.parametrize("units", [1, 2, 3])
@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2), (1, 3), (2, 3)])
def test_chimera_counts_equal_simulated_makespan(depth, units, forward, backward):
    num_microbatches = units * depth
    counts = critical_path_counts("chimera-direct", depth, num_microbatches)
    assert counts == (2 * units + depth - 2, units * (2 * depth - 2))
    _, _, result = simulate_schedule("chimera", depth, num_microbatches, forward, backward)
    assert result.makespan == pytest.approx(forward * counts[0] + backward * counts[1])
    costs = uniform(forward, backward, 0, 0, depth)
    assert closed_form_iteration_time("chimera-direct", depth, num_microbatches, costs) == \
        pytest.approx(simulated_iteration_time("chimera-direct", depth, num_microbatches, costs))


@pytest.mark.parametrize("scheme,name", [("1f1b", "1f1b"), ("gpipe", "gpipe")])
@pytest.mark.parametrize("depth,num_microbatches", [(1, 3), (2, 2), (4, 8), (8, 5)])
def test_one_f_one_b_and_gpipe_counts(scheme, name, depth, num_microbatches):
    assert critical_path_counts(scheme, depth, num_microbatches) == \
        (num_microbatches + depth - 1,) * 2
    _, _, result = simulate_schedule(name, depth, num_microbatches, 1, 2)
    assert result.makespan == pytest.approx(3 * (num_microbatches + depth - 1))


def test_no_closed_form_where_none_is_known():
    assert critical_path_counts("chimera-direct", 4, 6) is None
    assert critical_path_counts("chimera-forward-doubling", 4, 8) is None
    # Forward doubling with N = D is one basic unit.
    assert critical_path_counts("chimera-forward-doubling", 4, 4) == \
        critical_path_counts("chimera-direct", 4, 4)
    _, _, result = simulate_schedule("chimera", 4, 4, 1, 2, variant="forward-doubling")
    assert result.makespan == pytest.approx(1 * 4 + 2 * 6)
    assert closed_form_iteration_time("chimera-forward-doubling", 4, 8,
                                      uniform(1, 2, 0, 0, 4)) is None


@pytest.mark.parametrize("scheme", ["chimera-direct", "1f1b", "gpipe"])
@pytest.mark.parametrize("depth,units", [(4, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("p2p", [0.1, 0.5])
def test_closed_form_p2p_is_an_upper_bound_by_a_few_messages(scheme, depth, units, p2p):
    """The paper charges Cp2p on every critical-path op; the rendezvous simulator batches a
    send with the next receive, and the first forward / last backward need no message."""
    num_microbatches = units * depth
    costs = uniform(1, 2, p2p, 0, depth)
    closed = closed_form_iteration_time(scheme, depth, num_microbatches, costs)
    simulated = simulated_iteration_time(scheme, depth, num_microbatches, costs)
    zero = closed_form_iteration_time(scheme, depth, num_microbatches, uniform(1, 2, 0, 0, depth))
    assert simulated > zero  # p2p costs do show up in the simulation
    assert 0 <= closed - simulated <= (2 * units + 1) * p2p + 1e-9


@pytest.mark.parametrize("policy", ["eager-opt", "eager", "end"])
@pytest.mark.parametrize("scheme", ["chimera-direct", "1f1b"])
def test_uniform_allreduce_closed_form_bounds_the_simulator(policy, scheme):
    """Exact where every worker syncs at its end (1F1B, Chimera end sync); otherwise the closed
    form adds the worst worker's exposed sync to the critical path: an upper bound by less
    than one stage's all-reduce."""
    depth, num_microbatches = 8, 16
    costs = uniform(1, 2, 0, 3.0, depth)
    closed = closed_form_iteration_time(scheme, depth, num_microbatches, costs, policy)
    simulated = simulated_iteration_time(scheme, depth, num_microbatches, costs, policy)
    if scheme == "1f1b" or policy == "end":
        assert closed == pytest.approx(simulated)
    else:
        assert simulated - 1e-9 <= closed <= simulated + 3.0


def test_eager_sync_hides_late_stage_allreduce_and_closed_form_is_conservative():
    depth, num_microbatches = 8, 8
    # Late stages (4..7) have an expensive all-reduce, early stages a cheap one.
    allreduce = tuple(0.1 if stage < depth // 2 else 6.0 for stage in range(depth))
    costs = StageCosts(1, 2, 0, allreduce, (0,) * depth)
    compute = closed_form_iteration_time("chimera-direct", depth, num_microbatches,
                                         uniform(1, 2, 0, 0, depth))
    end = simulated_iteration_time("chimera-direct", depth, num_microbatches, costs, "end")
    eager = simulated_iteration_time("chimera-direct", depth, num_microbatches, costs, "eager")
    assert end == pytest.approx(compute + 6.1)  # both syncs share the link
    assert eager < end - 1.0
    assert closed_form_iteration_time("chimera-direct", depth, num_microbatches, costs,
                                      "eager") >= eager - 1e-9


# ----------------------------------------------------------------------------- formulas


def test_rabenseifner_allreduce():
    hardware = HardwareSpec(1e12, alpha=2e-6, beta=1e-9, device_memory_bytes=1e9)
    assert allreduce_time(hardware, 1, 1e6) == 0.0
    assert allreduce_time(hardware, 2, 1e6) == pytest.approx(2 * 1 * 2e-6 + 2 * 0.5 * 1e-3)
    assert allreduce_time(hardware, 16, 4e6) == pytest.approx(
        2 * 4 * 2e-6 + 2 * 15 / 16 * 1e-9 * 4e6)
    with pytest.raises(ValueError, match="at least one rank"):
        allreduce_time(hardware, 0, 1.0)
    assert num_replicas("chimera-direct", 8) == 16
    assert num_replicas("1f1b", 8) == 8


def test_gpt2_parameters_and_flops():
    assert total_parameters(GPT2) == 1_389_327_360  # the paper's count (chimera.md §8)
    b, s, h = 2, 632, 1280
    assert layer_forward_flops(GPT2, b) == pytest.approx(24 * b * s * h * h * (1 + s / (6 * h)))


@pytest.mark.parametrize("scheme", ["chimera-direct", "1f1b"])
def test_more_bandwidth_or_flops_is_never_slower(scheme):
    previous = math.inf
    for beta in (1e-8, 1e-9, 1e-10, 1e-11):
        hardware = HardwareSpec(1e12, 5e-6, beta, 16e9)
        time = evaluate(GPT2, hardware, scheme, 8, 8, 1, 16, False).simulated_time
        assert time <= previous
        previous = time
    slow = evaluate(GPT2, HardwareSpec(1e12, 5e-6, 1e-10, 16e9), scheme, 8, 8, 1, 16, False)
    fast = evaluate(GPT2, HardwareSpec(2e12, 5e-6, 1e-10, 16e9), scheme, 8, 8, 1, 16, False)
    assert fast.simulated_time < slow.simulated_time


def test_recompute_adds_the_recomputed_forward_to_the_backward():
    plain = evaluate(TINY, P100, "chimera-direct", 2, 4, 2, 4, False)
    full = evaluate(TINY, P100, "chimera-direct", 2, 4, 2, 4, True)
    selective = evaluate(TINY, P100, "chimera-direct", 2, 4, 2, 4, "selective")
    assert plain.costs.backward == pytest.approx(2 * plain.costs.forward)
    # Full: the stage's two layers re-run forward (the output layer is not recomputed).
    layers = TINY.num_layers // 4
    assert full.costs.backward - plain.costs.backward == pytest.approx(
        layers * layer_forward_flops(TINY, 2) / P100.flops_per_second)
    # Selective: only the attention core, 4·B·s²·h per layer.
    assert selective.costs.backward - plain.costs.backward == pytest.approx(
        layers * 4 * 2 * 32 ** 2 * 64 / P100.flops_per_second)
    assert full.max_memory < selective.max_memory < plain.max_memory


# ----------------------------------------------------------------------------- memory


def test_memory_uses_peak_activations_and_two_weight_copies_for_chimera():
    depth, num_microbatches = 8, 8
    peaks = peak_stored_microbatches("chimera-direct", depth, num_microbatches)
    assert list(peaks) == [depth // 2 + 1 + min(r, depth - 1 - r) for r in range(depth)]
    chimera = memory_per_worker(GPT2, P100, "chimera-direct", depth, num_microbatches, 1, False)
    one_f_one_b = memory_per_worker(GPT2, P100, "1f1b", depth, num_microbatches, 1, False)
    # Middle workers: Chimera holds two stages' weights and stores D micro-batches at the peak,
    # 1F1B one stage and D - r micro-batches.
    assert chimera[3] > one_f_one_b[3]
    assert max(chimera) < max(one_f_one_b) + 2 * 16 * total_parameters(GPT2) / depth


def test_search_picks_recompute_when_memory_is_tight():
    roomy = HardwareSpec(1e12, 5e-6, 1e-10, 64e9)
    tight = HardwareSpec(1e12, 5e-6, 1e-10, 10e9)  # between 7.6 and 13.7 GB
    best_roomy = search_configurations(GPT2, roomy, 64, 64, shapes=[(8, 8)],
                                       micro_batch_size=1)[0]
    best_tight = search_configurations(GPT2, tight, 64, 64, shapes=[(8, 8)],
                                       micro_batch_size=1)
    assert best_roomy.recompute == "none" and best_roomy.fits
    assert [e.recompute for e in best_tight] == ["full"] and best_tight[0].fits
    hopeless = search_configurations(GPT2, HardwareSpec(1e12, 5e-6, 1e-10, 2e9), 64, 64,
                                     shapes=[(8, 8)])
    assert len(hopeless) == 1 and not hopeless[0].fits


def test_largest_micro_batch_policy_takes_the_largest_that_fits():
    hardware = HardwareSpec(1e12, 5e-6, 1e-10, 16e9)
    largest = search_configurations(TINY, hardware, 8, 32, shapes=[(2, 4)], recompute=False,
                                    micro_batch_policy="largest")
    assert [e.micro_batch_size for e in largest] == [16]
    fastest = search_configurations(TINY, hardware, 8, 32, shapes=[(2, 4)], recompute=False)
    assert fastest[0].throughput >= largest[0].throughput


# ----------------------------------------------------------------------------- search


def test_valid_shapes():
    assert valid_shapes("chimera-direct", 512, 64, 512) == [
        (256, 2), (128, 4), (64, 8), (32, 16), (16, 32), (8, 64)]
    assert valid_shapes("1f1b", 12, 6, 12) == [(12, 1), (6, 2), (4, 3), (2, 6)]
    assert valid_shapes("1f1b", 12, 6, 4) == [(4, 3), (2, 6)]  # W must divide the batch


def test_search_enumerates_only_valid_configurations():
    estimates = search_configurations(TINY, P100, 16, 64,
                                      schemes=("chimera-direct", "chimera-forward-doubling",
                                               "1f1b", "gpipe"))
    assert estimates
    for estimate in estimates:
        width, depth = estimate.data_parallel, estimate.pipeline
        assert width * depth == 16 and TINY.num_layers % depth == 0
        assert width * estimate.micro_batch_size * estimate.num_microbatches == 64
        if estimate.scheme.startswith("chimera"):
            assert depth % 2 == 0
        if estimate.scheme == "chimera-forward-doubling":
            assert estimate.num_microbatches % depth == 0
    throughputs = [e.throughput for e in estimates if e.fits]
    assert throughputs == sorted(throughputs, reverse=True)


def test_compare_schemes_at_one_shape():
    free_network = HardwareSpec(1e9, alpha=0.0, beta=0.0, device_memory_bytes=16e9)
    estimates = compare_schemes(TINY, free_network, 2, 4, 1, 8, False,
                                schemes=("chimera-direct", "chimera-forward-doubling",
                                         "chimera-backward-halving", "1f1b", "gpipe"))
    by_scheme = {e.scheme: e for e in estimates}
    # Backward halving needs an even B: left out at B = 1.
    assert set(by_scheme) == {"chimera-direct", "chimera-forward-doubling", "1f1b", "gpipe"}
    # Fewer bubbles: with free communication Chimera beats 1F1B by the makespan ratio of
    # chimera.md §4: (N + D - 1)(F + Bk) / (K·D(F + Bk) + (D - 2)Bk + (K - 1)(D - 2)(Bk - F)).
    ratio = by_scheme["1f1b"].simulated_time / by_scheme["chimera-direct"].simulated_time
    assert ratio == pytest.approx((8 + 4 - 1) * 3 / (2 * 4 * 3 + 2 * 2 + 1 * 2 * 1))


# ----------------------------------------------------------------------------- CLI


@pytest.mark.distributed  # starts a process
def test_cli_prints_the_ranked_table():
    output = subprocess.run(
        [sys.executable, TOOL, "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "512",
         "--world-size", "8", "--global-batch-size", "32", "--schemes", "chimera-direct,1f1b",
         "--top", "5"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    lines = output.splitlines()
    assert lines[0].split()[:5] == ["scheme", "W", "D", "B", "N"]
    rows = [line.split() for line in lines[2:] if line.startswith(("chimera", "1f1b"))]
    assert 1 <= len(rows) <= 5
    seqs = [float(row[8]) for row in rows]
    assert seqs == sorted(seqs, reverse=True)


@pytest.mark.distributed  # starts a process
def test_cli_rejects_unknown_scheme():
    completed = subprocess.run(
        [sys.executable, TOOL, "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "512",
         "--world-size", "8", "--global-batch-size", "32", "--schemes", "pipedrem"],
        capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and "pipedrem" in completed.stderr
