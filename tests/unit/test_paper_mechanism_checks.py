"""benchmarks/paper_mechanism_checks.py: the variants of the model it checks reduce to the shipped
model where they must, and differ where their mechanism acts (docs/performance_model.md quotes
their numbers)."""

import dataclasses
import math
import importlib.util
import pathlib

import pytest

from megatron.performance_model import paper

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def checks():
    spec = importlib.util.spec_from_file_location("paper_mechanism_checks",
                                                  BENCHMARKS / "paper_mechanism_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hardware(checks):
    return checks.rp.hardware_of(checks.rp.load_fits()["in_sample"])


def bert48_run(nodes):
    return paper.PaperRun("", "chimera-direct", nodes // 4, 4, 8, 8, "none", 0, "")


def test_steady_state_hides_the_middle_workers_end_syncs_behind_their_fill(checks, hardware):
    result = checks.rp.estimate(hardware, bert48_run(64), checks.rp.BERT48, "eager-opt")
    period = checks.steady_state_period(result)
    # eager-opt's middle workers end last (both syncs after their last backward), and they
    # start the next iteration one forward later than workers 0 and D-1
    assert period < result.iteration_time - 0.01
    assert period >= result.iteration_time - result.costs.forward_of(1) - result.costs.p2p - 1e-9


def test_steady_state_equals_the_makespan_where_rank_0_binds(checks, hardware):
    run = paper.COMPARISON_2048[0]  # Chimera at 2,048 nodes: worker 0 ends last
    result = checks.rp.estimate(hardware, run)
    assert checks.steady_state_period(result) == pytest.approx(result.iteration_time, rel=1e-9)


def test_time_varying_contention_is_the_shipped_model_inside_one_group(checks, hardware):
    # 256 nodes fit in one 384-node dragonfly group: no contention either way
    run = paper.PaperRun("", "chimera-direct", 8, 32, 1, 32, "none", 0, "")
    assert checks._predict_contended(hardware, run) == pytest.approx(
        checks.rp.predict(hardware, run), rel=1e-9)


def test_time_varying_contention_speeds_up_staggered_syncs(checks, hardware):
    gpipe = next(run for run in paper.COMPARISON_2048 if run.label == "GPipe")
    assert checks._predict_contended(hardware, gpipe) > 1.05 * checks.rp.predict(hardware, gpipe)


def test_elementwise_bytes_grow_with_the_layers_and_recomputation(checks):
    model = checks.rp.GPT2_PAPER
    one = checks.elementwise_bytes(model, 1, 64, 5, "none")
    two = checks.elementwise_bytes(model, 1, 32, 5, "none")
    assert two[0] == pytest.approx(2 * one[0]) and two[1] == pytest.approx(2 * one[1])
    recomputed = checks.elementwise_bytes(model, 1, 64, 5, "full")
    assert recomputed[1] == pytest.approx(one[1] + one[0])
    last = checks.elementwise_bytes(model, 1, 64, 63, "none")
    assert last[0] > one[0] and last[1] > one[1]


def test_p2p_handoff_delay_adds_to_every_message_and_zero_is_the_shipped_model(checks, hardware):
    chimera = paper.COMPARISON_2048[0]
    shipped = checks.rp.estimate(hardware, chimera)
    with checks.with_p2p_handoff(0.0):
        assert checks.rp.predict(hardware, chimera) == pytest.approx(shipped.throughput,
                                                                      rel=1e-12)
    with checks.with_p2p_handoff(checks.CPYTHON_SWITCH_INTERVAL):
        delayed = checks.rp.estimate(hardware, chimera)
    assert checks.CPYTHON_SWITCH_INTERVAL == 5e-3
    assert delayed.costs.p2p == pytest.approx(shipped.costs.p2p + 5e-3)
    assert delayed.throughput < shipped.throughput
    # deeper pipelines have more hops on the critical path: W=16 D=32 loses more than W=64 D=8
    deep, shallow = paper.SWEEP_512[1], paper.SWEEP_512[3]
    with checks.with_p2p_handoff(checks.CPYTHON_SWITCH_INTERVAL):
        ratio = checks.rp.predict(hardware, shallow) / checks.rp.predict(hardware, deep)
    assert ratio > checks.rp.predict(hardware, shallow) / checks.rp.predict(hardware, deep)


def test_whole_stage_recompute_reruns_only_the_recomputing_last_stages_output_layer(
        checks, hardware):
    constants = checks.rp.constants_of(hardware)
    layers_only = checks.rp.hardware_of(constants, checks.recomputation_profile(False))
    whole = checks.rp.hardware_of(constants, checks.recomputation_profile(True))
    by_label = {run.label: run for run in checks.rp.FIT_POINTS}
    for label, run in by_label.items():
        before, after = (checks.rp.predict(profile, run) for profile in (layers_only, whole))
        if run.recompute == "none" or run.scheme in ("pipedream", "pipedream-2bw"):
            # nothing recomputed, or the authors' PipeDream runtime never recomputes the last
            # stage (the only one with the output layer)
            assert after == pytest.approx(before, rel=1e-12), label
        else:
            assert after < before, label


def test_the_shipped_profile_is_check_12(checks):
    assert checks.recomputation_profile(True, ("1f1b",)) == checks.rp.P100_ARIES


def test_split_sync_is_the_shipped_model_with_one_tensor_and_slower_with_the_authors_split(
        checks, hardware, monkeypatch):
    model = checks.rp.GPT2_PAPER
    assert [checks.split_sync_tensors(model, 32, s) for s in (0, 1, 30, 31)] == [4, 3, 3, 4]
    runs = [paper.SWEEP_512[1], paper.COMPARISON_2048[0], paper.COMPARISON_2048[2],
            paper.COMPARISON_2048[3], paper.COMPARISON_2048[1], paper.COMPARISON_2048[5]]
    split = {run.label: checks._predict_split_sync(hardware, run) for run in runs}
    monkeypatch.setattr(checks, "SPLIT_SYNC_MIDDLE", 1)
    monkeypatch.setattr(checks, "SPLIT_SYNC_END", 1)
    for run in runs:
        shipped = checks.rp.predict(hardware, run)
        assert checks._predict_split_sync(hardware, run) == pytest.approx(shipped, rel=1e-9)
        if run.scheme in ("pipedream-2bw", "gems"):
            assert split[run.label] == pytest.approx(shipped, rel=1e-12)
        else:
            # the extra ring latencies cost more where the ring is longer (2,048 nodes)
            assert split[run.label] < shipped
    loss_512 = 1 - split["W=16 D=32"] / checks.rp.predict(hardware, paper.SWEEP_512[1])
    loss_2048 = 1 - split["Chimera"] / checks.rp.predict(hardware, paper.COMPARISON_2048[0])
    assert loss_2048 > loss_512


def _flushed(label):
    return next(run for run in paper.COMPARISON_2048 if run.label == label)


def _free_syncs(costs):
    zero = tuple(0.0 for _ in costs.allreduce)
    return dataclasses.replace(costs, allreduce=zero, allreduce_alone=zero)


def test_gpipe_syncing_every_backward_is_the_shipped_gpipe_when_syncs_are_free(checks, hardware):
    gpipe = _flushed("GPipe")
    result = checks.rp.estimate(hardware, gpipe)
    free = _free_syncs(result.costs)
    _, count = checks.schedule_microbatches(gpipe.scheme, gpipe.pipeline,
                                            gpipe.micro_batch_size, gpipe.num_microbatches)
    shipped_free = checks.timing.simulated_iteration_time(gpipe.scheme, gpipe.pipeline, count,
                                                          free)
    assert checks.gpipe_syncing_every_backward(gpipe, free) == pytest.approx(shipped_free,
                                                                             rel=1e-12)
    # with DDP's syncs every backward holds its rank for (most of) a stage all-reduce: at least
    # N of them on the last stage's critical path, against one after the flush
    ddp = checks.ddp_allreduce_costs(hardware, result)
    every = checks.gpipe_syncing_every_backward(gpipe, ddp)
    assert every > result.iteration_time + (count - 1) * 0.5 * min(ddp.allreduce)


def test_ddp_allreduce_costs_pay_a_ring_latency_per_bucket_and_less_alone(checks, hardware):
    result = checks.rp.estimate(hardware, _flushed("1F1B/DAPPLE"))
    ddp = checks.ddp_allreduce_costs(hardware, result)
    for shipped, bucketed, alone in zip(result.costs.allreduce, ddp.allreduce,
                                        ddp.allreduce_alone):
        assert bucketed > shipped  # one ring latency per 25 MiB bucket instead of one
        assert alone < bucketed  # 2,048 nodes: the job-wide contention is gone alone


def test_one_f_one_b_flush_under_ddp_replays_1f1b_and_blocks_on_its_syncs(checks, hardware):
    run = _flushed("1F1B/DAPPLE")
    result = checks.rp.estimate(hardware, run)
    free = _free_syncs(result.costs)
    _, count = checks.schedule_microbatches(run.scheme, run.pipeline, run.micro_batch_size,
                                            run.num_microbatches)
    simulated = checks.timing.simulated_iteration_time(run.scheme, run.pipeline, count, free)
    replayed = checks.one_f_one_b_flush_under_ddp(run, free, alone=False)
    # the replay holds a rank for its op plus one exchange; the simulator pairs exchanges:
    # the same 1F1B order, within a few per cent
    assert replayed == pytest.approx(simulated, rel=0.05)
    ddp = checks.ddp_allreduce_costs(hardware, result)
    contended = checks.one_f_one_b_flush_under_ddp(run, ddp, alone=False)
    alone = checks.one_f_one_b_flush_under_ddp(run, ddp, alone=True)
    # each stage's blocking sync delays the gradient the stage below waits for: they chain
    # (one exposed sync alone would cost at most max(ddp.allreduce_alone), 0.36 s here)
    assert alone - replayed > 0.5 * sum(ddp.allreduce_alone) > 3 * max(ddp.allreduce_alone)
    assert contended > alone


def test_bucketed_flush_syncs_touch_only_gpipe_and_1f1b_and_cost_the_longer_ring_more(
        checks, hardware):
    for run in checks.rp.FIT_POINTS:
        shipped = checks.rp.predict(hardware, run)
        bucketed = checks._predict_bucketed_flush_syncs(hardware, run)
        if run.scheme in checks.FLUSHED_SCHEMES:
            assert bucketed < shipped, run.label
        else:
            assert bucketed == pytest.approx(shipped, rel=1e-12), run.label
    gpipe, one_f_one_b = _flushed("GPipe"), _flushed("1F1B/DAPPLE")
    lost = {run.label: 1 - checks._predict_bucketed_flush_syncs(hardware, run)
            / checks.rp.predict(hardware, run) for run in (gpipe, one_f_one_b)}
    # GPipe's first stage: more buckets (892 vs 577 MB) on a ring twice as long (256 vs 128)
    assert lost["GPipe"] > 2 * lost["1F1B/DAPPLE"]


def test_eager_sync_requirement_reads_the_published_ratio_backwards(checks, hardware):
    rows = checks.eager_sync_requirement(hardware)
    assert [row["nodes"] for row in rows] == [nodes for nodes, _ in paper.SYNC_POLICY]
    for row, (nodes, published) in zip(rows, paper.SYNC_POLICY):
        opt = checks.rp.estimate(hardware, bert48_run(nodes), checks.rp.BERT48, "eager-opt")
        eager = checks.rp.estimate(hardware, bert48_run(nodes), checks.rp.BERT48, "eager")
        assert row["need"] == pytest.approx(published * opt.iteration_time
                                            - eager.iteration_time, rel=1e-12)
        assert row["ring_steps"] == 2 * (2 * (nodes // 4) - 1)
    # the docs' claims: at 32 and 64 nodes eager must cost more than the whole overlapped sync
    # and more than the backward it overlaps (sigma > 1), and no single per-ring-step delay
    # gives all three ratios (the required delay differs by more than 2x between node counts)
    assert all(row["sync_stretch"] > 1 and row["sigma"] > 1 for row in rows[1:])
    per_step = [row["per_ring_step"] for row in rows]
    assert max(per_step) > 2 * min(per_step)


def test_copy_engine_bound_is_small_and_does_not_rise_with_the_nodes(checks, hardware):
    bounds = [checks.copy_engine_bound(hardware, bert48_run(nodes))
              for nodes, _ in paper.SYNC_POLICY]
    assert all(1.0 < bound < 1.02 for bound in bounds)
    assert bounds[-1] <= bounds[0]


def test_ring_step_delay_zero_is_the_shipped_ratio_and_a_delay_makes_it_rise(checks, hardware):
    for nodes, _ in paper.SYNC_POLICY:
        run = bert48_run(nodes)
        shipped = (checks.rp.estimate(hardware, run, checks.rp.BERT48, "eager").iteration_time
                   / checks.rp.estimate(hardware, run, checks.rp.BERT48,
                                        "eager-opt").iteration_time)
        # eager-opt / eager in throughput = T(eager) / T(eager-opt)
        assert checks.eager_ring_step_delay_ratio(hardware, run, 0.0) == pytest.approx(
            shipped, rel=1e-9)
    ratios = [checks.eager_ring_step_delay_ratio(hardware, bert48_run(nodes), 9e-3)
              for nodes, _ in paper.SYNC_POLICY]
    assert ratios[0] < ratios[1] < ratios[2]
    assert ratios[0] < 1.01 and ratios[2] > 1.05


def test_last_stage_kept_speeds_up_only_1f1b(checks, hardware):
    runs = {run.label: run for run in paper.COMPARISON_2048}
    constants = checks.rp.constants_of(hardware)
    for whole_stage in (False, True):
        recomputed, kept = (checks.rp.hardware_of(constants,
                                                  checks.recomputation_profile(whole_stage, k))
                            for k in ((), ("1f1b",)))
        before = {label: checks.rp.predict(recomputed, run) for label, run in runs.items()}
        after = {label: checks.rp.predict(kept, run) for label, run in runs.items()}
        assert after["1F1B/DAPPLE"] > 1.05 * before["1F1B/DAPPLE"]
        for label in runs:
            if label != "1F1B/DAPPLE":
                assert after[label] == pytest.approx(before[label], rel=1e-12)


def test_only_1f1bs_last_stage_fits_without_recomputation(checks, hardware):
    # GPipe's last stage holds all N micro-batches at its peak, 1F1B's one (Table 2: N·Ma vs
    # [Ma, D·Ma], the last stage at the low end): only 1F1B's can keep its activations
    runs = {run.label: run for run in paper.COMPARISON_2048}
    device = hardware.device_memory_bytes
    assert checks.last_stage_memory_without_recompute(hardware, runs["1F1B/DAPPLE"]) < device
    assert checks.last_stage_memory_without_recompute(hardware, runs["GPipe"]) > device


def test_authors_recomputation_reruns_whole_stages_but_1f1bs_last(checks, hardware):
    # the shipped profile (check 12): run_backward re-runs the whole stage (the last one's
    # output layer too): Bk = 3F on GPipe's last stage; 1F1B's last stage keeps its
    # activations: Bk = 2F; before 2026-12-02 both re-ran the layers only
    runs = {run.label: run for run in paper.COMPARISON_2048}
    gpipe = checks.rp.estimate(hardware, runs["GPipe"]).costs
    one_f_one_b = checks.rp.estimate(hardware, runs["1F1B/DAPPLE"]).costs
    chimera = checks.rp.estimate(hardware, paper.SWEEP_512[3]).costs  # D=8, recompute
    assert gpipe.stage_backward[-1] == pytest.approx(3 * gpipe.stage_forward[-1], rel=1e-9)
    assert one_f_one_b.stage_backward[-1] == pytest.approx(2 * one_f_one_b.stage_forward[-1],
                                                           rel=1e-9)
    for costs in (gpipe, one_f_one_b, chimera):
        assert costs.stage_backward[0] == pytest.approx(3 * costs.stage_forward[0], rel=1e-9)
    assert chimera.stage_backward[-1] == pytest.approx(3 * chimera.stage_forward[-1], rel=1e-9)
    before = checks.rp.hardware_of(checks.rp.constants_of(hardware),
                                   checks.recomputation_profile(False))
    for label in ("GPipe", "1F1B/DAPPLE"):
        old = checks.rp.estimate(before, runs[label]).costs
        assert 2 * old.stage_forward[-1] + 1e-6 < old.stage_backward[-1] < (
            3 * old.stage_forward[-1] - 1e-6)


def test_held_out_summary_reads_the_reports_leave_one_out_numbers(checks):
    data = {"points": [{"label": "a", "published": 100.0, "leave_one_out": 110.0},
                       {"label": "b", "published": 200.0, "leave_one_out": 180.0}],
            "speedups": {"X": {"leave_one_out": 1.2}},
            "order_2048": {"leave_one_out": ["Chimera", "X"]},
            "weak_scaling_efficiency": {"leave_one_out": 0.9},
            "sweep_best": {"leave_one_out": "W=16 D=32"}}
    summary = checks.held_out_summary(data)
    expected = ((math.log(1.1) ** 2 + math.log(0.9) ** 2) / 2) ** 0.5
    assert summary["loo_rms_log_error"] == pytest.approx(expected, rel=1e-12)
    assert summary["speedups"] == {"X": 1.2} and summary["points"] == {"a": 110.0, "b": 180.0}
