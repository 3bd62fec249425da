"""Tier 0: the network-contention and overlap-slowdown terms of the performance model, the
PipeDream-2BW stage-by-stage syncs, and hardware profiles as JSON (hand-computed cases and the
simulator)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron.performance_model import (
    GPT2_PAPER, P100_ARIES, HardwareSpec, StageCosts, allreduce_time, cross_group_fraction,
    evaluate, hardware_from_dict, load_profile, network_contention, overlap_delay,
    pipedream_2bw_time, save_profile, simulated_iteration_time)

DRAGONFLY = HardwareSpec(1e12, alpha=0.0, beta=1e-9, device_memory_bytes=16e9,
                         nodes_per_group=384, global_bandwidth_fraction=0.25)


def test_cross_group_fraction_hand_cases():
    assert cross_group_fraction(DRAGONFLY, 384) == 0.0  # the job fits in one group
    assert cross_group_fraction(DRAGONFLY, 100) == 0.0
    assert cross_group_fraction(DRAGONFLY, 512) == pytest.approx(0.25)
    assert cross_group_fraction(DRAGONFLY, 2048) == pytest.approx(1 - 384 / 2048)
    flat = dataclasses.replace(DRAGONFLY, nodes_per_group=0)
    assert cross_group_fraction(flat, 4096) == 0.0


def test_network_contention_is_the_bottleneck_of_injection_and_global_links():
    # max(1, c/γ): 512 nodes c = 0.25 = γ (injection still the bottleneck), 1,024 nodes
    # c = 0.625 -> 2.5, 2,048 nodes c = 0.8125 -> 3.25.
    assert network_contention(DRAGONFLY, 512) == pytest.approx(1.0)
    assert network_contention(DRAGONFLY, 1024) == pytest.approx(2.5)
    assert network_contention(DRAGONFLY, 2048) == pytest.approx(3.25)
    untapered = dataclasses.replace(DRAGONFLY, global_bandwidth_fraction=1.0)
    assert network_contention(untapered, 2048) == 1.0  # full global bandwidth: no slowdown


def test_contention_scales_only_the_bandwidth_term_of_the_allreduce():
    hardware = dataclasses.replace(DRAGONFLY, alpha=1e-5)
    alone = allreduce_time(hardware, 8, 1e6)
    slowed = allreduce_time(hardware, 8, 1e6, contention=3.0)
    latency = 2 * 3 * 1e-5
    assert alone == pytest.approx(latency + 2 * 7 / 8 * 1e-9 * 1e6)
    assert slowed - latency == pytest.approx(3 * (alone - latency))
    with pytest.raises(ValueError, match="slowdown >= 1"):
        allreduce_time(hardware, 8, 1e6, contention=0.5)


def test_stage_costs_use_the_jobs_node_count():
    # W·D = 2,048 nodes: every stage's all-reduce is 3.25x the uncontended one (alpha = 0).
    flat = dataclasses.replace(DRAGONFLY, nodes_per_group=0)
    contended = evaluate(GPT2_PAPER, DRAGONFLY, "chimera-direct", 64, 32, 1, 32, "none").costs
    alone = evaluate(GPT2_PAPER, flat, "chimera-direct", 64, 32, 1, 32, "none").costs
    assert [a / b for a, b in zip(contended.allreduce, alone.allreduce)] == \
        pytest.approx([3.25] * 32)
    assert contended.forward == alone.forward and contended.p2p == alone.p2p
    small = evaluate(GPT2_PAPER, DRAGONFLY, "chimera-direct", 8, 32, 1, 32, "none").costs
    assert small.allreduce == pytest.approx(
        evaluate(GPT2_PAPER, flat, "chimera-direct", 8, 32, 1, 32, "none").costs.allreduce)


def test_hardware_rejects_impossible_network_constants():
    with pytest.raises(ValueError, match="global_bandwidth_fraction"):
        HardwareSpec(1e12, 0, 0, 1e9, global_bandwidth_fraction=0)
    with pytest.raises(ValueError, match="nodes_per_group"):
        HardwareSpec(1e12, 0, 0, 1e9, nodes_per_group=-1)
    with pytest.raises(ValueError, match="overlap_slowdown"):
        HardwareSpec(1e12, 0, 0, 1e9, overlap_slowdown=-0.1)


def test_overlap_delay_hand_cases():
    # Compute fully under the sync, no gap: σ × overlap.
    assert overlap_delay([(0, 1), (1, 2)], [(0.5, 1.5)], 1.0) == pytest.approx(1.0)
    # A gap of 1 after the overlapped op absorbs up to 1 of the stretch.
    assert overlap_delay([(0, 1), (2, 3)], [(0, 1)], 0.5) == pytest.approx(0.0)
    assert overlap_delay([(0, 1), (2, 3)], [(0, 1)], 2.0) == pytest.approx(1.0)
    # Overlapping windows are merged (a second sync does not double the slowdown).
    assert overlap_delay([(0, 2)], [(0, 2), (1, 2)], 1.0) == pytest.approx(2.0)
    # No slowdown, no window, or a window after the compute: nothing.
    assert overlap_delay([(0, 1)], [(0, 1)], 0.0) == 0.0
    assert overlap_delay([(0, 1)], [], 1.0) == 0.0
    assert overlap_delay([(0, 1)], [(1, 3)], 1.0) == 0.0


def test_overlap_slowdown_makes_eager_opt_beat_eager_in_the_simulator():
    # Chimera D=4, N=8, F=1, Bk=2, all-reduce 3 per stage. Without the slowdown eager sync
    # wins (it hides more); with σ = 1 the middle workers' eager sync runs under their last
    # backward, which has no idle time after it: +σ·min(all-reduce, Bk) = +2. eager-opt does
    # not launch it there; the edge workers' stretch is absorbed by their tail's idle time.
    def time(policy, slowdown):
        costs = StageCosts(1.0, 2.0, 0.0, (3.0,) * 4, (0,) * 4, slowdown)
        return simulated_iteration_time("chimera-direct", 4, 8, costs, policy)

    assert time("eager", 0.0) < time("eager-opt", 0.0) < time("end", 0.0)
    assert time("eager", 1.0) == pytest.approx(time("eager", 0.0) + 2.0)
    assert time("eager-opt", 1.0) == pytest.approx(time("eager-opt", 0.0))
    assert time("eager-opt", 1.0) < time("eager", 1.0)
    assert time("end", 1.0) == pytest.approx(time("end", 0.0))  # nothing overlaps


def test_pipedream_2bw_syncs_stage_by_stage_without_the_jobs_contention():
    # 2BW's blocking syncs follow one another down the pipeline: each runs while the other
    # stages compute, so it pays the all-reduce of one stage's replicas alone on the network
    # (allreduce_alone), not the contention of the whole job syncing at once.
    contended = StageCosts(1.0, 2.0, 0.0, (30.0,) * 4, (0,) * 4, 0.0, (), (), (3.0,) * 4)
    alone = StageCosts(1.0, 2.0, 0.0, (3.0,) * 4, (0,) * 4)
    assert pipedream_2bw_time(4, 8, contended) == pytest.approx(pipedream_2bw_time(4, 8, alone))
    costs = evaluate(GPT2_PAPER, P100_ARIES, "pipedream-2bw", 128, 16, 1, 16, "full",
                     stage_balance="per-stage").costs
    assert all(a < b for a, b in zip(costs.allreduce_alone, costs.allreduce))


def test_profile_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(str(path), P100_ARIES, source="test", measurements={"x": [1, 2]})
    assert load_profile(str(path)) == P100_ARIES
    data = json.loads(path.read_text())
    assert data["source"] == "test" and data["measurements"] == {"x": [1, 2]}
    assert hardware_from_dict({"flops_per_second": 1e12, "alpha": 0, "beta": 0,
                               "device_memory_bytes": 1e9}).op_overhead_seconds == 0.0


def test_profile_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware field.*flops_per_secnd"):
        hardware_from_dict({"flops_per_secnd": 1e12})
    with pytest.raises(ValueError, match="cannot read hardware profile"):
        load_profile(str(tmp_path / "missing.json"))
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"format": 99, "hardware": {}}))
    with pytest.raises(ValueError, match="format 99"):
        load_profile(str(future))
