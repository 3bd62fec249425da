"""benchmarks/emulated_depth.py: the sleeping stage really splits its backward, the simulated
table uses the same charges on both sides, and a tiny gloo run (D = 4, N = 4, one round) works."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import _emulated_stages  # noqa: E402
import emulated_depth  # noqa: E402
from _emulated_stages import EmulatedStage, uniform_times  # noqa: E402

from megatron.core.pipeline_parallel.execution.split_backward import (  # noqa: E402
    backward_input, backward_weight)


class _VirtualClock:
    """Stands in for ``time`` in _emulated_stages: a sleep records its length and advances the
    clock by it (the module's own work takes no time)."""

    def __init__(self, slept: list, tick: float = 0.0):
        self.slept, self.now, self.tick = slept, 0.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick  # ``tick``: work between two readings of the clock
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("first", [False, True])
def test_emulated_stage_sleeps_input_and_weight_halves_apart(first, monkeypatch):
    slept = []
    monkeypatch.setattr(_emulated_stages, "time", _VirtualClock(slept))
    times = uniform_times(2, 1, 0.1, 0.2, 0.3)
    stage = EmulatedStage(times, range(1), pre_process=first, post_process=False,
                          param_floats_per_layer=8, activation_floats=4)
    x = torch.ones(1, 4, requires_grad=not first)
    output = stage(x)
    assert slept == pytest.approx([0.1])
    grad = torch.ones_like(output)
    input_grad, deferred = backward_input(output, grad, None if first else x,
                                          list(stage.parameters()))
    input_half, slept[:] = list(slept[1:]), []
    backward_weight(deferred)
    if first:  # no input gradient: the whole backward (I + W) runs in the weight half
        assert input_grad is None and input_half == []
        assert sorted(slept) == pytest.approx([0.2, 0.3])
        assert stage.gain.grad is not None
    else:
        assert input_grad is not None and input_half == pytest.approx([0.2])
        assert slept == pytest.approx([0.3])
    assert stage.weight.grad is not None


@pytest.mark.parametrize("whole", [True, False])
def test_an_ops_own_work_counts_towards_its_time(whole, monkeypatch):
    """Every clock reading costs 0.05 s of 'work': F ends F after it started; a whole backward
    (one autograd pass) ends I + W after it started, the work between its halves included; split
    halves each take their own time."""
    clock = _VirtualClock([], tick=0.05)
    monkeypatch.setattr(_emulated_stages, "time", clock)
    stage = EmulatedStage(uniform_times(2, 1, 1.0, 0.2, 0.3), range(1, 2), pre_process=False,
                          post_process=False, param_floats_per_layer=8, activation_floats=4)
    x = torch.ones(1, 4, requires_grad=True)
    output = stage(x)
    assert clock.now == pytest.approx(1.0 + 0.05)  # the first reading starts the op
    grad = torch.ones_like(output)
    if whole:
        begin = clock.now
        output.backward(grad)
        assert clock.now - begin == pytest.approx(0.5 + 0.05)
    else:
        begin = clock.now
        _, deferred = backward_input(output, grad, x, list(stage.parameters()))
        assert clock.now - begin == pytest.approx(0.2 + 0.05)
        begin = clock.now
        backward_weight(deferred)
        assert clock.now - begin == pytest.approx(0.3 + 0.05)


def test_a_modules_weight_grows_with_its_layers():
    """--param-floats is per stage of 1/D of the model (2 layers): a stage of both layers holds all
    of it, a chunk of one layer (interleaved and V schedules, both runtimes) half, as in a real
    model, so splitting the model into more chunks adds no weight, gradient or all-reduce bytes."""
    per_layer, activation_floats = emulated_depth.module_sizes(1000, 16)
    assert (per_layer, activation_floats) == (500, 16)
    times = uniform_times(4, emulated_depth.LAYERS_PER_STAGE, 0.0, 0.0, 0.0)
    stage = EmulatedStage(times, range(2, 4), False, False, per_layer, activation_floats)
    chunks = [EmulatedStage(times, range(layer, layer + 1), False, False, per_layer,
                            activation_floats) for layer in (2, 3)]
    assert stage.weight.numel() == 1000
    assert [chunk.weight.numel() for chunk in chunks] == [500, 500]


def test_simulated_table_charges_both_sides_alike():
    rows = emulated_depth.simulated_table([4], [1], lambda depth: uniform_times(depth, 2, 1, 1, 1))
    by_label = {label: (efficiency, peak, copies) for _, _, label, efficiency, peak, copies
                in rows}
    assert by_label["ours 1f1b"][0] == pytest.approx(12 / 21)  # (N + D - 1)(F + B)
    assert by_label["torch Schedule1F1B"][0] == pytest.approx(12 / 21)
    assert by_label["ours 1f1b split"][0] == pytest.approx(12 / 15)  # ZB-H1: 3N + D - 1
    assert by_label["ours chimera split"][0] == pytest.approx(12 / 13)  # 3N + D/2 - 1
    assert by_label["torch ScheduleZBVZeroBubble"][0] == pytest.approx(12 / 15)
    assert by_label["ours chimera split"][1:] == (4, 2)  # D micro-batches, two weight copies
    assert by_label["torch ScheduleDualPipeV"][0] is None  # refuses N < 2D


def test_latency_tolerant_plans_beat_the_free_message_plans_when_messages_cost():
    unit = 1.0
    charged = emulated_depth.Calibration(0.05, (0.015, 0.015, 0.03))
    rows = emulated_depth.simulated_table([4], [2], lambda depth: uniform_times(
        depth, 2, unit, unit, unit), charged)
    by_label = {label: efficiency for _, _, label, efficiency, _, _ in rows}
    assert by_label["ours chimera split δ"] > by_label["ours chimera split"]
    assert by_label["ours chimera interleaved split δ"] > by_label["ours chimera interleaved split"]
    best_torch = max(value for label, value in by_label.items()
                     if label.startswith("torch") and value is not None)
    assert by_label["ours chimera interleaved split δ"] > best_torch
    free = emulated_depth.simulated_table([4], [2], lambda depth: uniform_times(
        depth, 2, unit, unit, unit))
    assert "ours chimera split δ" not in {label for _, _, label, _, _, _ in free}


def test_fitted_message_latency_reproduces_a_measured_time():
    times = uniform_times(4, 2, 0.08, 0.08, 0.08)
    flags = dict(emulated_depth.our_variants(4))["ours chimera split"]
    overheads = (0.001, 0.001, 0.002)
    measured = emulated_depth.simulate_ours(flags, 4, 8, times, emulated_depth.Calibration(
        0.003, overheads))[0]
    fitted = emulated_depth.fit_message_seconds(flags, 4, 8, times, overheads, measured)
    assert fitted == pytest.approx(0.003, abs=1e-4)
    assert emulated_depth.fit_message_seconds(flags, 4, 8, times, overheads, 0.1) == 0.0


def test_arguments():
    args = emulated_depth.parse_args([])
    assert (args.depths, args.counts, args.unit_ms, args.rounds) == ([4, 8, 16], [1, 2, 4], 80, 2)
    with pytest.raises(SystemExit):
        emulated_depth.parse_args(["--depths", "5"])
    assert args.message_ms is None and args.overhead_ms is None  # measured runs calibrate
    assert args.calibrate == "timeline" and not args.report_hops
    assert emulated_depth.parse_args(["--calibrate", "ring"]).calibrate == "ring"
    with pytest.raises(SystemExit):
        emulated_depth.parse_args(["--message-ms", "-1"])


@pytest.mark.distributed
def test_tiny_run_measures_every_configuration():
    times = uniform_times(4, 2, 0.002, 0.002, 0.002)
    per_rank = emulated_depth.measure(4, [1], times, (64, 16), 1, None, timeout=120,
                                      report_hops=True)
    measured = per_rank[0][4]
    labels = set(measured["times"])
    assert {label for label, _ in emulated_depth.our_variants(4, True)} <= labels
    calibration = per_rank[0]["calibration"]
    assert 0 <= calibration.message_seconds <= 0.05 and min(calibration.overhead_seconds) >= 0
    assert calibration.ring_hop_seconds > 0
    # the default calibration is the timeline's: two recorded runs, their pooled median planned
    assert len(calibration.timeline_hops) == emulated_depth.TIMELINE_RUNS
    assert all(median <= p90 for median, p90 in calibration.timeline_hops)
    assert 0 < calibration.message_seconds < 0.05
    assert 0 <= calibration.fitted_seconds <= 0.05
    assert all(rank["calibration"] == calibration for rank in per_rank)  # one plan everywhere
    assert "torch ScheduleZBVZeroBubble" in labels and "torch Schedule1F1B" in labels
    assert all(seconds[0] > 0 for seconds in measured["times"].values())
    assert max(rank[4]["peaks"]["ours chimera split"] for rank in per_rank) <= 4
    report = emulated_depth.measured_report(4, per_rank, times)
    assert "best ours" in report and "measured/sim free" in report
    assert "measured/sim calibrated" in report and "calibrated message hop" in report
    assert "timeline hop median" in report and "fitted hop" in report
    hops = measured["hops"]["ours chimera split δ"]
    assert hops["messages"] > 0 and 0 <= hops["post_lag_median"] < 0.05
    assert "consumers waited" in report


def test_timeline_hop_seconds_pools_the_waited_hops_of_every_run():
    from megatron.core.pipeline_parallel.execution.timeline import MessageHop

    def hop(delay, waited=True):  # posted at 0; the consumer asked at 0 (waited) or at the end
        return MessageHop(("activation", 0, 0, 0), 0, 1, 0.0, 0.0, 0.0,
                          0.0 if waited else delay, delay)

    delta, per_run = emulated_depth.timeline_hop_seconds(
        [[hop(0.002), hop(0.003), hop(0.5, waited=False)], [hop(0.004), hop(0.005)]])
    assert delta == pytest.approx(0.0035)  # median of 2, 3, 4, 5 ms; the unwaited hop left out
    assert per_run[0][0] == pytest.approx(0.0025) and per_run[1][1] == pytest.approx(0.005)
    assert emulated_depth.timeline_hop_seconds([[hop(0.5, waited=False)]])[0] == 0.0


def test_profile_times_from_stage_list_or_measure_output(tmp_path):
    import json

    from _emulated_stages import profile_times
    stages = tmp_path / "stages.json"
    stages.write_text(json.dumps({"stages": [[0.01, 0.02, 0.03], [0.02, 0.02, 0.02]]}))
    times = profile_times(str(stages), 2, 2, 0.5)
    assert times.per_stage(2) == [pytest.approx((0.01, 0.02, 0.03)),
                                  pytest.approx((0.02, 0.02, 0.02))]
    assert times.per_stage(4)[0] == pytest.approx((0.005, 0.01, 0.015))  # one layer each
    measured = tmp_path / "profile.json"
    measured.write_text(json.dumps({"measurements": {"compute": [
        {"layers": 2, "micro_batch_size": 1, "forward_s": 0.01, "backward_s": 0.03}]}}))
    assert profile_times(str(measured), 2, 2, 1 / 3).per_stage(2)[1] == pytest.approx(
        (0.01, 0.01, 0.02))
    with pytest.raises(ValueError, match="needs 3 entries"):
        profile_times(str(stages), 3, 2, 0.5)


def test_profiled_rank_counts_our_own_python_per_compute_op():
    """profile_emulated_rank.py's share of our Python: only functions under megatron/ count."""
    import cProfile
    import pstats

    import profile_emulated_rank
    from megatron.training.process_tree import child_pids

    profiler = cProfile.Profile()
    profiler.enable()
    child_pids(os.getpid())  # Python of ours: a loop over /proc
    sorted(range(200_000), key=lambda value: -value)  # not ours (a builtin and this test's lambda)
    profiler.disable()
    stats = pstats.Stats(profiler)
    ours = profile_emulated_rank.our_own_seconds(stats)
    everything = sum(entry[2] for entry in stats.stats.values())  # type: ignore[attr-defined]
    assert 0 < ours < everything
    times = emulated_depth.equal_unit_times(2, 0.01)  # the script's 0.01 ms units
    # Chimera + split at D = 2, N = 2, rank 0: F of both micro-batches, I and W of the second
    # (stage 1 of the up pipeline), B of the first (a first stage: its backward is one op)
    assert profile_emulated_rank.compute_ops("ours chimera split", 2, 2, times, 0) == 5


@pytest.mark.distributed
def test_profiled_rank_runs(capsys):
    import profile_emulated_rank
    result = profile_emulated_rank.main(["--depth", "2", "--count", "1", "--iterations", "2",
                                         "--warmup", "1", "--only", "ours chimera split",
                                         "--rank", "0", "--top", "3"])
    assert result == 0
    printed = capsys.readouterr().out
    assert "ms per iteration without the profiler" in printed
    assert "ms per compute op (5 compute ops)" in printed  # D = 2, N = 2, rank 0
    with pytest.raises(SystemExit):
        profile_emulated_rank.parse_args(["--only", "no such configuration"])
