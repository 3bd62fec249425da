"""Tier 0: the paper's runs as the authors ran them (job scripts of github.com/Shigangli/Chimera,
branch ChimeraBk), their memory decisions against Table 2, the published numbers as
transcribed, and the baselines' replayed schedules against hand cases."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.performance_model import (
    GPT2_PAPER, P100_ARIES, ModelSpec, StageCosts, evaluate)
from megatron.performance_model import paper
from megatron.performance_model.baselines import (
    ddp_backward_with_sync, gems_step_time, no_flush_interval_time)

RUNS = {run.label: run for run in paper.COMPARISON_2048}


@pytest.mark.parametrize("label, scheme, depth, micro_batch, recompute, script", [
    ("Chimera", "chimera-direct", 32, 1, "none", "daint_gpt2_chimera_512nodes_16w32d.sh"),
    ("PipeDream-2BW", "pipedream-2bw", 16, 1, "full", "gpt2_512nodes_32w16d_pipedream2bw.sh"),
    ("PipeDream", "pipedream", 8, 2, "full", "gpt2_512nodes_64w8d_pipedream.sh"),
    ("GEMS", "gems", 8, 2, "none", "gems_64w8d_2b_gpt2.sh"),
])
def test_runs_are_set_as_the_authors_scripts_ran_them(label, scheme, depth, micro_batch,
                                                      recompute, script):
    run = RUNS[label]
    assert (run.scheme, run.pipeline, run.micro_batch_size, run.recompute) == (
        scheme, depth, micro_batch, recompute)
    assert script in run.script
    assert run.nodes == 2048
    # GEMS updates after its script's 6 accumulation steps (one down and one up micro-batch
    # each); every other run uses the paper's mini-batch of 2,048.
    expected = 256 * 2 * 2 * 6 if label == "GEMS" else 2048
    assert run.global_batch_size == expected


def test_gems_update_is_its_scripts_accumulation():
    run = RUNS["GEMS"]
    assert paper.GEMS_ACCUMULATION_STEPS == 6
    assert "--gradient_accumulation_steps 6" in run.script
    assert run.num_microbatches == 2 * paper.GEMS_ACCUMULATION_STEPS


def test_runs_without_a_script_follow_the_paper_and_say_so():
    assert (RUNS["1F1B/DAPPLE"].pipeline, RUNS["1F1B/DAPPLE"].recompute) == (16, "full")
    assert (RUNS["GPipe"].pipeline, RUNS["GPipe"].recompute) == (8, "full")
    for label in ("1F1B/DAPPLE", "GPipe"):
        assert "no job script" in RUNS[label].script
    # PipeDream-2BW updates every D micro-batches (update_interval = D × accumulation 1).
    assert RUNS["PipeDream-2BW"].num_microbatches == RUNS["PipeDream-2BW"].pipeline


def test_the_sweeps_depth_8_row_keeps_the_papers_mini_batch_not_its_scripts_accumulation():
    """The D=8 script the row cites accumulates 3 units (N = 24, mini-batch 1,536); the sweep
    ran mini-batch 512 (chimera.md §8), so the row keeps N = 8 and says why."""
    run = {r.label: r for r in paper.SWEEP_512}["W=64 D=8 recompute"]
    assert "--gradient_accumulation_steps 3" in run.script
    assert (run.pipeline, run.micro_batch_size, run.num_microbatches, run.recompute) == (
        8, 1, 8, "full")
    assert all(r.global_batch_size == 512 for r in paper.SWEEP_512)


def test_the_papers_own_model_of_the_sweep_is_transcribed_row_by_row():
    """chimera.md §8 pairs each sweep row's measurement with the paper's model: 117/128,
    140/149, 129/138, 143/143; the model's best is not the measurement's."""
    assert set(paper.SWEEP_512_PAPERS_MODEL) == {r.label for r in paper.SWEEP_512}
    assert [paper.SWEEP_512_PAPERS_MODEL[r.label] for r in paper.SWEEP_512] == [128, 149, 138,
                                                                                143]
    assert max(paper.SWEEP_512_PAPERS_MODEL, key=paper.SWEEP_512_PAPERS_MODEL.get) != \
        paper.SWEEP_BEST_MEASURED


def test_bert48_pipedream_2bw_is_its_scripts_run_at_double_width():
    """daint_bert48_32nodes_pipedream2bw_4wx8d_16b.sh: 4 x 8, B=16, recomputation, an update
    every D micro-batches; at 64 nodes only W doubles."""
    run = paper.BERT48_PIPEDREAM_2BW_64
    assert "daint_bert48_32nodes_pipedream2bw_4wx8d_16b.sh" in run.script
    assert (run.scheme, run.data_parallel, run.pipeline, run.micro_batch_size,
            run.num_microbatches, run.recompute) == ("pipedream-2bw", 8, 8, 16, 8, "full")
    assert run.nodes == 64
    assert paper.BERT48_SPEEDUP_OVER_PIPEDREAM_2BW_64 == 1.17
    # the script's recomputation is needed: without it a stage's activations do not fit
    bert48 = ModelSpec(num_layers=48, hidden_size=1024, num_attention_heads=16,
                       seq_length=128, vocab_size=30522, max_position_embeddings=512)

    def fits(recompute):
        return evaluate(bert48, P100_ARIES, run.scheme, run.data_parallel, run.pipeline,
                        run.micro_batch_size, run.num_microbatches, recompute,
                        stage_balance="per-stage").fits
    assert fits("full") and not fits("none")


@pytest.mark.parametrize("run", paper.SWEEP_512 + paper.COMPARISON_2048, ids=lambda r: r.label)
def test_memory_decisions_match_the_papers(run):
    """Table 2 memory per scheme: what ran with recomputation does not fit without it, what ran
    without fits as it ran."""
    def fits(recompute):
        return evaluate(GPT2_PAPER, P100_ARIES, run.scheme, run.data_parallel, run.pipeline,
                        run.micro_batch_size, run.num_microbatches, recompute,
                        stage_balance="per-stage").fits
    assert fits(run.recompute)
    if run.recompute == "full":
        assert not fits("none")


def test_published_numbers_are_transcribed():
    assert paper.PUBLISHED_SPEEDUPS == {"PipeDream-2BW": 1.16, "1F1B/DAPPLE": 1.38,
                                        "GPipe": 1.42, "PipeDream": 2.01, "GEMS": 2.34}
    assert paper.PUBLISHED_WEAK_SCALING_EFFICIENCY == 0.914
    assert [run.published for run in paper.COMPARISON_2048] == [513, 440, 372, 361, 256, 220]


def test_gems_step_reproduces_table_2_bubble_ratio():
    for depth in (2, 4, 8, 16):
        costs = StageCosts(1.0, 2.0, 0.0, (0.0,) * depth, (0,) * depth)
        step = gems_step_time(depth, costs)
        work = 2 * 3.0  # one down and one up micro-batch per worker
        assert 1 - work / step == pytest.approx((depth - 1) / (depth + 0.5))


def test_no_flush_replay_runs_at_the_slowest_stage_and_blocks_on_syncs():
    # The last stage twice as slow: the pipeline runs at its pace.
    costs = StageCosts(1.0, 2.0, 0.0, (0.0,) * 4, (0,) * 4, 0.0, (1, 1, 1, 2), (2, 2, 2, 4))
    assert no_flush_interval_time(4, 8, costs) == pytest.approx(8 * 6)
    # A sync on every micro-batch of the slowest stage adds to each of its micro-batches (no
    # gradient bytes given: one bucket, nothing overlaps): F + Bk + AR per micro-batch.
    synced = StageCosts(1.0, 2.0, 0.0, (0.0, 0.0, 0.0, 5.0), (0,) * 4, 0.0,
                        (1, 1, 1, 2), (2, 2, 2, 4))
    assert no_flush_interval_time(4, 1, synced) == pytest.approx(2 + 4 + 5)


def test_ddp_sync_overlaps_the_backward_bucket_by_bucket():
    # 100 MiB of gradients in 25 MiB buckets: the first is ready after a quarter of Bk.
    costs = StageCosts(1.0, 2.0, 0.0, (4.0,), (100 * 2 ** 20,))
    assert ddp_backward_with_sync(costs, 0) == pytest.approx(max(2 + 1, 0.5 + 4))
    short = StageCosts(1.0, 2.0, 0.0, (0.4,), (100 * 2 ** 20,))
    assert ddp_backward_with_sync(short, 0) == pytest.approx(2 + 0.1)


def test_ddp_sync_waits_for_the_recomputed_forward():
    """The authors' runtime re-runs the whole stage's forward before autograd.backward, so no
    bucket is ready before R = Bk − 2F: the first bucket after R + a quarter of the rest."""
    recomputed = StageCosts(1.0, 3.0, 0.0, (4.0,), (100 * 2 ** 20,))
    assert ddp_backward_with_sync(recomputed, 0) == pytest.approx(max(3 + 1, 1 + 0.5 + 4))
    # per stage: the last stage (Bk = 2F, not recomputed) starts its first bucket at once
    per_stage = StageCosts(1.0, 3.0, 0.0, (4.0, 4.0), (100 * 2 ** 20,) * 2, 0.0, (1.0, 1.5),
                           (3.0, 3.0))
    assert ddp_backward_with_sync(per_stage, 0) == pytest.approx(1 + 0.5 + 4)
    assert ddp_backward_with_sync(per_stage, 1) == pytest.approx(0.75 + 4)
    # a sync shorter than the gradient computation still ends one bucket after the backward
    short = StageCosts(1.0, 3.0, 0.0, (0.4,), (100 * 2 ** 20,))
    assert ddp_backward_with_sync(short, 0) == pytest.approx(3 + 0.1)


def test_two_bw_needs_an_update_interval_of_at_least_the_depth():
    with pytest.raises(ValueError, match="N >= D"):
        evaluate(GPT2_PAPER, P100_ARIES, "pipedream-2bw", 256, 16, 1, 8, "full")


def test_ddp_schemes_pay_the_ring_latency_once_per_bucket():
    """PipeDream and PipeDream-2BW sync through DDP (25 MiB buckets, one ring all-reduce
    each); GEMS and the schedule-backed schemes all-reduce one flattened message per stage."""
    from megatron.performance_model.costs import (
        DDP_BUCKET_BYTES, allreduce_time, ddp_buckets, network_contention)
    from megatron.performance_model.timing import stage_costs

    assert ddp_buckets(1) == 1 and ddp_buckets(DDP_BUCKET_BYTES) == 1
    assert ddp_buckets(DDP_BUCKET_BYTES + 1) == 2
    hardware = P100_ARIES
    one = allreduce_time(hardware, 8, 1e8)
    three = allreduce_time(hardware, 8, 1e8, messages=3)
    assert three - one == pytest.approx(2 * 2 * (8 - 1) * hardware.alpha)
    for scheme, expected_messages in (("pipedream", True), ("gems", False)):
        costs = stage_costs(GPT2_PAPER, hardware, scheme, 256, 8, 2, "full", "per-stage")
        size = costs.gradient_bytes[3]
        replicas = 256 * (2 if scheme == "gems" else 1)
        single = allreduce_time(hardware, replicas, size,
                                network_contention(hardware, 2048, replicas))
        extra = (ddp_buckets(size) - 1) * 2 * (replicas - 1) * hardware.alpha
        assert costs.allreduce_alone[3] == pytest.approx(single + (extra if expected_messages
                                                                   else 0.0))


def test_gems_amortises_its_sync_over_the_accumulated_steps():
    """The same GEMS run with 2 or 6 steps per update: the per-sequence throughput rises
    because the two stage syncs at the update are paid once per update."""
    few = evaluate(GPT2_PAPER, P100_ARIES, "gems", 256, 8, 2, 4, "none", stage_balance="per-stage")
    many = evaluate(GPT2_PAPER, P100_ARIES, "gems", 256, 8, 2, 12, "none",
                    stage_balance="per-stage")
    assert many.throughput > few.throughput
    # Six steps cost three times two steps' compute plus one sync, not three syncs.
    sync = few.iteration_time - 2 * (many.iteration_time - few.iteration_time) / 4
    assert many.iteration_time == pytest.approx(3 * (few.iteration_time - sync) + sync, rel=1e-6)


def test_optimizer_step_is_paid_per_update():
    """The AdamW step (72 bytes per parameter at the device's memory bandwidth) follows each
    update: once per iteration for Chimera and GEMS, once per micro-batch for PipeDream."""


    from megatron.performance_model.costs import (
        OPTIMIZER_STEP_BYTES_PER_PARAMETER, optimizer_step_time)

    assert optimizer_step_time(dataclasses.replace(P100_ARIES, memory_bandwidth=0.0), 1e9) == 0
    assert optimizer_step_time(P100_ARIES, 1e9) == pytest.approx(
        1e9 * OPTIMIZER_STEP_BYTES_PER_PARAMETER / P100_ARIES.memory_bandwidth)
    free = dataclasses.replace(P100_ARIES, memory_bandwidth=0.0)

    def times(scheme, width, depth, micro_batch, count, recompute):
        return [evaluate(GPT2_PAPER, hardware, scheme, width, depth, micro_batch, count,
                         recompute, stage_balance="per-stage")
                for hardware in (P100_ARIES, free)]

    paid, unpaid = times("pipedream", 256, 8, 2, 4, "full")
    steps = [paid.costs.optimizer_step_of(stage) for stage in range(8)]
    assert min(steps) > 0
    # Four updates per iteration; the replay runs at the pace of the slowest stage.
    assert 4 * min(steps) <= paid.iteration_time - unpaid.iteration_time <= 4 * max(steps) + 1e-9
    paid, unpaid = times("chimera-direct", 64, 32, 1, 32, "none")
    hosted = [paid.costs.optimizer_step_of(s) + paid.costs.optimizer_step_of(31 - s)
              for s in range(32)]
    assert 0 < paid.iteration_time - unpaid.iteration_time <= max(hosted) + 1e-9


def test_gloo_stages_every_message_through_the_host():
    """gloo on CUDA tensors copies each message to the host and the result back over the
    card's PCIe 3.0 x16 link (15.75 GB/s per direction, stated): 2·L / that bandwidth on top
    of the network terms, for p2p and all-reduce alike, not slowed by contention."""


    from megatron.performance_model.costs import allreduce_time, host_staging_time, p2p_time
    from megatron.performance_model.specs import PCIE3_X16_BANDWIDTH

    assert PCIE3_X16_BANDWIDTH == pytest.approx(15.75e9, rel=1e-3)
    bare = dataclasses.replace(P100_ARIES, host_staging_bandwidth=0.0)
    assert host_staging_time(bare, 1e9) == 0.0
    assert host_staging_time(P100_ARIES, 1e9) == pytest.approx(2e9 / PCIE3_X16_BANDWIDTH)
    assert p2p_time(P100_ARIES, 1e6) - p2p_time(bare, 1e6) == pytest.approx(2e6 / 15.75e9,
                                                                            rel=1e-3)
    for contention in (1.0, 3.0):
        extra = (allreduce_time(P100_ARIES, 64, 1e8, contention)
                 - allreduce_time(bare, 64, 1e8, contention))
        assert extra == pytest.approx(2e8 / PCIE3_X16_BANDWIDTH)
    assert allreduce_time(P100_ARIES, 1, 1e8) == 0.0


@pytest.mark.parametrize("scheme, recomputes_last", [
    ("pipedream-2bw", False), ("pipedream", False), ("1f1b", False), ("gpipe", True)])
def test_the_authors_runtimes_recompute_whole_stages_but_never_the_1f1b_last(scheme,
                                                                             recomputes_last):
    # main_with_runtime.py (baselines/gpt2_pipedream2bw): recompute_step = args.recompute_step
    # and r.stage != (r.num_stages - 1) on its 1F1B-scheduled loop (PipeDream, PipeDream-2BW;
    # 1F1B here: P100_ARIES.last_stage_kept), every stage on --gpipe; run_backward re-runs the
    # whole stage, the last stage's output layer included (P100_ARIES.recompute_whole_stage)
    from megatron.performance_model import stage_costs
    depth = 8
    assert P100_ARIES.recompute_whole_stage and P100_ARIES.last_stage_kept == ("1f1b",)
    costs = stage_costs(GPT2_PAPER, P100_ARIES, scheme, 4, depth, 1, "full", "per-stage")
    forward, backward = costs.stage_forward, costs.stage_backward
    assert backward[0] == pytest.approx(3 * forward[0])  # a middle/first stage recomputes
    assert backward[-1] == pytest.approx((3 if recomputes_last else 2) * forward[-1])


@pytest.mark.parametrize("scheme", ["1f1b", "gpipe"])
def test_megatron_style_recomputation_reruns_the_layers_only_on_every_stage(scheme):
    from megatron.performance_model import stage_costs
    from megatron.performance_model.costs import recompute_flops
    megatron_style = dataclasses.replace(P100_ARIES, recompute_whole_stage=False,
                                         last_stage_kept=())
    depth = 8
    costs = stage_costs(GPT2_PAPER, megatron_style, scheme, 4, depth, 1, "full", "per-stage")
    layers = recompute_flops(GPT2_PAPER, depth, 1, "full", depth - 1) / P100_ARIES.flops_per_second
    assert costs.stage_backward[-1] == pytest.approx(2 * costs.stage_forward[-1] + layers)
    assert recompute_flops(GPT2_PAPER, depth, 1, "full", depth - 1, whole_stage=True) > (
        recompute_flops(GPT2_PAPER, depth, 1, "full", depth - 1))
    assert recompute_flops(GPT2_PAPER, depth, 1, "full", 3, whole_stage=True) == (
        recompute_flops(GPT2_PAPER, depth, 1, "full", 3))


def test_1f1bs_last_rank_keeps_its_full_activations_and_gpipes_does_not():
    from megatron.performance_model.costs import activation_bytes
    from megatron.performance_model.memory import memory_per_worker
    depth, replicas = 16, 128
    megatron_style = dataclasses.replace(P100_ARIES, last_stage_kept=())
    kept = memory_per_worker(GPT2_PAPER, P100_ARIES, "1f1b", depth, 16, 1, "full", replicas)
    all_recomputed = memory_per_worker(GPT2_PAPER, megatron_style, "1f1b", depth, 16, 1, "full",
                                       replicas)
    # one micro-batch in flight on 1F1B's last rank: its full activations instead of the
    # recomputation's stored inputs, and no recomputed layer in its working set
    assert kept[:-1] == all_recomputed[:-1]
    assert kept[-1] > all_recomputed[-1]
    assert kept[-1] - all_recomputed[-1] <= (activation_bytes(GPT2_PAPER, 1, depth, "none",
                                                              [depth - 1]) + 1.0)
    assert max(kept) < P100_ARIES.device_memory_bytes  # the paper's 1F1B run still fits
    gpipe = memory_per_worker(GPT2_PAPER, P100_ARIES, "gpipe", 8, 8, 1, "full", 256)
    assert gpipe == memory_per_worker(GPT2_PAPER, megatron_style, "gpipe", 8, 8, 1, "full", 256)


def test_the_last_pipedream_rank_keeps_its_full_activations():
    from megatron.performance_model.baselines import baseline_memory
    from megatron.performance_model.costs import activation_bytes
    from megatron.performance_model.memory import state_bytes, working_bytes
    depth, replicas = 8, 4
    memory = baseline_memory(GPT2_PAPER, P100_ARIES, "pipedream-2bw", depth, 1, "full", replicas)
    last = depth - 1
    state = state_bytes(GPT2_PAPER, P100_ARIES, depth, [last], replicas, weight_versions=2)
    overhead = P100_ARIES.framework_overhead_bytes

    def last_rank(mode):  # one micro-batch in flight on the last rank (D - r = 1)
        return (state + activation_bytes(GPT2_PAPER, 1, depth, mode, [last]) + overhead
                + working_bytes(GPT2_PAPER, depth, 1, mode, True))

    assert memory[-1] == pytest.approx(last_rank("none"))
    assert memory[-1] > last_rank("full")
    first = state_bytes(GPT2_PAPER, P100_ARIES, depth, [0], replicas, weight_versions=2)
    assert memory[0] == pytest.approx(first + depth * activation_bytes(GPT2_PAPER, 1, depth, "full")
                                      + overhead + working_bytes(GPT2_PAPER, depth, 1, "full",
                                                                 False))


@pytest.mark.parametrize("balance", ["balanced", "slowest"])
def test_every_stage_balance_skips_the_last_stages_recomputation(balance):
    from megatron.performance_model import stage_costs
    from megatron.performance_model.costs import recompute_flops
    depth = 8
    skipped = (recompute_flops(GPT2_PAPER, depth, 1, "full", depth - 1,
                               P100_ARIES.recompute_whole_stage)
               / P100_ARIES.flops_per_second)
    pipedream = stage_costs(GPT2_PAPER, P100_ARIES, "pipedream-2bw", 4, depth, 1, "full", balance)
    gpipe = stage_costs(GPT2_PAPER, P100_ARIES, "gpipe", 4, depth, 1, "full", balance)
    share = 1 / depth if balance == "balanced" else 1.0
    assert gpipe.backward - pipedream.backward == pytest.approx(skipped * share)