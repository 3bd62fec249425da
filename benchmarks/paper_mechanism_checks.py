"""Mechanisms checked against the Chimera paper's numbers, all but one NOT adopted in the model
(check 12, the authors' recomputation, is shipped since 2026-12-02): the numbers
docs/performance_model.md quotes for them ("Checked and not adopted").

``python benchmarks/paper_mechanism_checks.py [--skip-slow]``. No torch, no processes; about
3 minutes on a 2-core machine (the refits; 1.5 minutes measured on 2026-12-02, about 3 with
check 9's refit and held-out fits), ``--skip-slow`` only checks 1, 2, 9 and 10 without refits
(seconds); checks 11/12 recompute every fit of the report twice (about two minutes more).

Each check is a variant of the shipped model written here, next to it, so the model itself
stays as it is (checks 7, 11 and 12 as hardware profiles of the model's own recomputation
settings):

1. ``steady_state``: the authors' training loops run iterations back to back without a barrier
   (``main_with_runtime.py``: ``#distrib.barrier()`` commented out in the Chimera loop;
   ``run_training_loop_with_flushes`` / ``..._1f1b_flushes`` barrier only per epoch), and each
   rank's "Average time per update step" spans many iterations on that rank. So a rank's
   end-of-iteration syncs can hide behind its own start offset in the next iteration: the
   period is max over ranks of (end of its syncs and step − start of its first op), not the
   cold-start makespan. Printed: that period beside the makespan, for every schedule-backed
   GPT-2 row and for the Bert-48 sync-policy ratio.
2. ``head_of_line``: an upper bound on what the middle workers' eager all-reduce could cost
   the point-to-point messages of the remaining backward (the brief's "shares the node's
   link"): the whole rest of that all-reduce after their last backward, added to the eager
   iteration; and the fair-share cost per message.
3. ``time_varying_contention``: κ counts the nodes syncing *at the moment* (a fluid model:
   load = pipeline ranks with a sync in flight / D), instead of all P nodes for every sync;
   refitted in-sample.
4. ``elementwise_traffic``: the memory-bound element-wise passes of the authors' HF GPT-2
   ``Block`` (counted from ``modeling_gpt2.py`` and ``activations.gelu_new``, fp32) and of
   the loss, at the P100's 732 GB/s, added to F and Bk per layer; refitted in-sample.
5. ``op_overhead``: a fixed per-op overhead (a fourth constant, which the issue does not
   allow): the o at which the 512-node sweep's best would change, refitted in-sample, and the
   planner's first choice there.
6. ``p2p_handoff``: a delay δ on every point-to-point message. The authors' ``_send``
   (``communication.py``) runs in a helper thread that needs the GIL, and its
   ``tensor.cpu()`` copies on the default CUDA stream behind whatever the main thread queued
   meanwhile; CPython hands the GIL to a waiting thread after at most its switch interval
   (``sys.getswitchinterval()``, 5 ms by default). δ = 2 and 5 ms, refitted in-sample.
7. ``whole_stage_recompute`` (:func:`recomputation_profile` ``(True)``): the authors' Chimera
   runtime recomputes by re-running the whole stage (``run_backward``:
   ``self._run_forward(tensors, recompute_step=False)`` over every module of the stage), so
   with ``--recompute_step`` the last stage also re-runs the output layer and the loss (three
   layers' FLOPs at GPT-2). Alone (1F1B's last stage recomputing too), at the shipped
   constants and refitted; part of the shipped model since 2026-12-02 (check 12).
8. ``split_sync``: the authors' ``AdamW.grads_sync`` (``transformers/optimization.py``)
   all-reduces a stage's gradient as 3 tensors, 4 on the first and last stage (its
   ``boundaries`` table), each paying the ring's 2(r − 1)α; applied to Chimera, 1F1B and GPipe
   (which would use the same ``AdamW``), refitted, with the weak-scaling efficiency held out
   as the report holds it out (one fit without both end points).
9. ``published_flush_paths``: the code paths the authors published for the flushed baselines
   (GPipe, 1F1B), at the in-sample constants, no refit. GPipe: the GEMS baseline's
   ``main_with_runtime_gems.py --gpipe`` runs ``run_training_loop_with_flushes`` without DDP
   and its ``AdamW.step`` all-reduces the stage's flattened gradient, blocking, after the
   flush: the shipped model's assumption (that main reads the reverse pipeline's stage map
   unconditionally to build its per-stage groups, so even for GPipe it needs a reverse
   configuration, and is not a clean GPipe path either); the PipeDream-2BW baseline's
   ``--gpipe`` wraps each
   replicated stage in ``DistributedDataParallel`` and never enters ``no_sync()`` in that loop
   (its own comment: "weight synchronization will happen every backward pass"): every
   backward all-reduces (:func:`gpipe_syncing_every_backward`). 1F1B: the Chimera runtime's
   ``--dapple`` cannot run as published (``AdamW`` without ``num_stages``: ``step()`` indexes
   an empty list of handles); the PipeDream-2BW runtime defines
   ``run_training_loop_with_1f1b_flushes`` (DDP under ``no_sync()`` but for the last
   backward, whose all-reduce blocks the rank before it sends its input gradient), which no
   published ``main`` calls (:func:`one_f_one_b_flush_under_ddp`).
10. ``eager_sync_requirement``: the sync-policy ratio (Bert-48, D=4, B=8, N=8) read backwards:
   how much longer than the shipped model's eager iteration the published eager-opt / eager
   ratio makes plain eager sync at 16 / 32 / 64 nodes, and what that extra would mean in each
   form a cost of the middle workers' eagerly launched late-stage sync can take (a delay per
   ring step, 2(r - 1) of them with r = 2W; a stretch of that sync; a slowdown σ of the
   backward it overlaps). Beside it two forward checks at the in-sample constants, no refit:
   the stated bound of the staging copy (:func:`copy_engine_bound`: a CUDA device runs one
   copy per direction at a time, so the gradient message the other middle worker produces
   with its eager launch can queue behind that launch's device-to-host copy of the stage
   gradient, at most L / 15.75 GB/s), and the ratio a per-ring-step delay δ of the overlapped
   sync would give (:func:`eager_ring_step_delay_ratio`; δ has no stated value: a fourth
   constant).
11. ``last_stage_kept`` (:func:`recomputation_profile` ``(False, ("1f1b",))``): 1F1B's last
   stage without recomputation, GPipe's still recomputing. The authors' PipeDream-2BW
   ``main_with_runtime.py`` (gpt2) makes exactly this split: its 1F1B-scheduled loop
   (``run_training_loop``, PipeDream and PipeDream-2BW) gets ``recompute_step =
   args.recompute_step and r.stage != (r.num_stages - 1)``, its ``--gpipe`` loop
   ``args.recompute_step`` on every stage; and GPipe's last stage could not keep its
   activations anyway (it holds all N micro-batches: :func:`last_stage_memory_without_recompute`),
   1F1B's holds one. But the one published ``--dapple`` path (the Chimera main) passes
   ``args.recompute_step`` to ``run_training_loop_with_1f1b_flushes`` on every stage, the last
   included. Alone (layers-only recomputation elsewhere), every fit of the report recomputed.
12. Checks 7 and 11 together, i.e. recomputation as the authors' runtimes do it: the shipped
   ``P100_ARIES`` profile since 2026-12-02 (``recompute_whole_stage=True,
   last_stage_kept=("1f1b",)``). Printed beside the model before it (layers only, every
   stage), every fit recomputed for both variants (:func:`check_recomputation`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import reproduce_paper as rp  # noqa: E402
from megatron.performance_model import (  # noqa: E402
    baselines, costs as cost_terms, paper, timing)
from megatron.performance_model.schemes import (  # noqa: E402
    ANALYTIC_SCHEMES, lowered_schedule, num_replicas, schedule_microbatches)
from megatron.performance_model.specs import P100_MEMORY_BANDWIDTH  # noqa: E402

START = {"efficiency": 0.392, "bandwidth": 6.84e9, "global_bandwidth_fraction": 0.157}


def _timelines(result, policy):
    """(ready time of each stage's sync, every rank's timing.RankCompute, micro-batches)."""
    _, count = schedule_microbatches(result.scheme, result.pipeline, result.micro_batch_size,
                                     result.num_microbatches)
    ready, ranks = timing.sync_ready_times(timing.compute_timelines(
        result.scheme, result.pipeline, count, result.costs, policy))
    return ready, ranks, count


def _rank_ends(result, policy, finish_times):
    ready, ranks, count = _timelines(result, policy)
    layout, _ = lowered_schedule(result.scheme, result.pipeline, count, policy)
    finishes = finish_times(ready, ranks)
    stage_end = {}
    for rank, done in zip(ranks, finishes):
        for stage, end in zip(rank.stages, done):
            stage_end[stage] = max(stage_end.get(stage, 0.0), end)
    ends = [max([rank.end] + [stage_end[s] for s in rank.stages])
            + sum(result.costs.optimizer_step_of(s) for _, s in layout.hosted(index))
            for index, rank in enumerate(ranks)]
    return ends, [rank.first for rank in ranks]


def _shared(result):
    def finish_times(ready, ranks):
        return [cost_terms.shared_link_finish_times([(ready[s], result.costs.allreduce[s])
                                                     for s in rank.stages])
                for rank in ranks]
    return finish_times


def steady_state_period(result, policy="eager-opt") -> float:
    """Check 1: max over ranks of (end of its syncs and step − its first op's start)."""
    ends, firsts = _rank_ends(result, policy, _shared(result))
    return max(end - first for end, first in zip(ends, firsts))


def check_steady_state(hardware) -> list:
    lines = ["1. Steady state without a barrier (authors' loops): period vs cold-start makespan"
             " (s, in-sample constants)"]
    for run in rp.FIT_POINTS:
        if run.scheme in ANALYTIC_SCHEMES:
            continue
        result = rp.estimate(hardware, run)
        lines.append(f"   {run.label:22} makespan {result.iteration_time:.3f}  steady "
                     f"{steady_state_period(result):.3f}")
    ratios = []
    for nodes, published in paper.SYNC_POLICY:
        run = paper.PaperRun("", "chimera-direct", nodes // 4, 4, 8, 8, "none", 0, "")
        opt = rp.estimate(hardware, run, rp.BERT48, "eager-opt")
        eager = rp.estimate(hardware, run, rp.BERT48, "eager")
        ratios.append(f"{nodes} nodes {eager.iteration_time / opt.iteration_time:.3f} -> "
                      f"{steady_state_period(eager, 'eager') / steady_state_period(opt):.3f}"
                      f" (paper {published:.2f})")
    lines.append("   Bert-48 eager-opt / eager, makespan -> steady state: " + ", ".join(ratios))
    return lines


def check_head_of_line(hardware) -> list:
    lines = ["2. Eager all-reduce vs the remaining backward's p2p on the middle workers "
             "(Bert-48 D=4 B=8 N=8, in-sample constants)"]
    message = 8 * rp.BERT48.seq_length * rp.BERT48.hidden_size * rp.BERT48.bytes_per_value
    for nodes, published in paper.SYNC_POLICY:
        run = paper.PaperRun("", "chimera-direct", nodes // 4, 4, 8, 8, "none", 0, "")
        opt = rp.estimate(hardware, run, rp.BERT48, "eager-opt")
        eager = rp.estimate(hardware, run, rp.BERT48, "eager")
        late, backward = opt.costs.allreduce[2], opt.costs.backward_of(1)
        rest = max(0.0, late - backward)
        lines.append(
            f"   {nodes} nodes: late-stage sync {late:.3f} s, last backward {backward:.3f} s, "
            f"left {rest:.3f} s; head-of-line bound on the ratio "
            f"{(eager.iteration_time + rest) / opt.iteration_time:.3f} (paper {published:.2f}); "
            f"fair share: +{hardware.beta * message * 1e3:.2f} ms per {message / 1e6:.1f} MB "
            "message")
    return lines


def _contended(result, hardware):
    """Check 3's sync finish times: a fluid model with κ following the ranks in flight."""
    costs = result.costs
    nodes = result.data_parallel * result.pipeline
    replicas = num_replicas(result.scheme, result.data_parallel, result.pipeline)
    slope = (cost_terms.cross_group_fraction(hardware, nodes)
             / hardware.global_bandwidth_fraction)
    full = cost_terms.network_contention(hardware, nodes)
    bandwidth = [2 * (replicas - 1) / replicas * hardware.beta * size if replicas > 1 else 0.0
                 for size in costs.gradient_bytes]

    def alone(stage, load):
        if costs.allreduce[stage] <= 0:
            return 0.0
        return costs.allreduce[stage] - bandwidth[stage] * (full - max(1.0, slope * load))

    def finish_times(ready, ranks):
        jobs = [[(ready[s], s) for s in rank.stages] for rank in ranks]
        progress = [[0.0] * len(j) for j in jobs]
        finish = [[start for start, _ in j] for j in jobs]
        starts = sorted({start for j in jobs for start, _ in j})
        now = starts[0] if starts else 0.0
        while True:
            active = [[k for k, (start, _) in enumerate(j) if start <= now and progress[r][k] < 1]
                      for r, j in enumerate(jobs)]
            later = [t for t in starts if t > now]
            if not any(active):
                if not later:
                    return finish
                now = later[0]
                continue
            load = sum(1 for a in active if a) / len(jobs)
            rates, step = {}, (later[0] - now) if later else math.inf
            for r, a in enumerate(active):
                for k in a:
                    solo = alone(jobs[r][k][1], load)
                    if solo <= 0:
                        progress[r][k], finish[r][k] = 1.0, now
                        continue
                    rates[(r, k)] = 1.0 / (solo * len(a))
                    step = min(step, (1 - progress[r][k]) / rates[(r, k)])
            for (r, k), rate in rates.items():
                progress[r][k] += rate * step
                if progress[r][k] >= 1 - 1e-12:
                    progress[r][k], finish[r][k] = 1.0, now + step
            now += step
    return finish_times


def _predict_contended(hardware, run):
    result = rp.estimate(hardware, run)
    if run.scheme in ANALYTIC_SCHEMES:
        return result.throughput
    ends, _ = _rank_ends(result, "eager-opt", _contended(result, hardware))
    return run.global_batch_size / max(ends)


def _refit_lines(title, predict=None, base=rp.P100_ARIES) -> list:
    patch = (mock.patch.object(rp, "predict", predict) if predict
             else mock.patch.object(rp, "predict", rp.predict))
    with patch:
        fitted = rp.fit(rp.FIT_POINTS, START, base, 30, {})
        hardware = rp.hardware_of(fitted, base)
        values = {run.label: rp.predict(hardware, run) for run in rp.FIT_POINTS}
    lines = [f"{title}: refitted in-sample efficiency {fitted['efficiency']:.3f}, "
             f"{fitted['bandwidth'] / 1e9:.2f} GB/s, γ {fitted['global_bandwidth_fraction']:.3f},"
             f" RMS log error {fitted['rms_log_error']:.4f}"]
    lines += [f"   {run.label:22} published {run.published:5.0f}  in-sample "
              f"{values[run.label]:7.1f} ({values[run.label] / run.published - 1:+.1%})"
              for run in rp.FIT_POINTS]
    weak = values[paper.COMPARISON_2048[0].label] / (4 * values[paper.SWEEP_512[1].label])
    lines.append(f"   weak scaling {weak:.1%}; 1F1B / GPipe "
                 f"{values['1F1B/DAPPLE'] / values['GPipe']:.3f}; sweep W=64 D=8 / W=16 D=32 "
                 f"{values['W=64 D=8 recompute'] / values['W=16 D=32']:.3f}")
    return lines, hardware


def elementwise_bytes(model, micro_batch_size, num_stages, stage, recompute):
    """Check 4: (forward, backward) bytes of one stage's memory-bound element-wise passes
    (fp32). Per layer, counted from the authors' HF GPT-2 Block: attention scores S = B·a·s²
    (scale, causal ``where``, softmax, dropout: 9.25 S forward, 10.25 S backward), gelu_new on
    B·s·ffn (8 kernels: 19 forward, ~40 backward), layer norms, residual adds, dropouts,
    head merge and the ``present`` stack on T = B·s·h (28.5 T forward, 30 T backward) and the
    weight gradients' accumulation (3 passes over the layer's parameters); the last stage's
    log-softmax loss over B·s·V and lm_head gradient; stage 0's embedding gradient."""
    s, h, a, vocab = model.seq_length, model.hidden_size, model.num_attention_heads, \
        model.vocab_size
    scores = micro_batch_size * a * s * s
    tokens = micro_batch_size * s * h
    ffn = micro_batch_size * s * model.ffn
    layer_forward = 9.25 * scores + 28.5 * tokens + 19 * ffn
    layer_backward = 10.25 * scores + 30 * tokens + 40 * ffn + 3 * (12 * h * h + 13 * h)
    layers = cost_terms.stage_layers(model, num_stages, stage)
    forward, backward = layers * layer_forward, layers * layer_backward
    if recompute == "full":
        backward += layers * layer_forward
    if stage == num_stages - 1:
        forward += 2 * tokens + 3 * micro_batch_size * s * vocab
        backward += 4 * tokens + 3 * micro_batch_size * s * vocab + 3 * h * vocab
    if stage == 0:
        forward += 7.25 * tokens
        backward += 2 * tokens + 4 * vocab * h + 3 * model.positions * h
    return forward * model.bytes_per_value, backward * model.bytes_per_value


def _with_elementwise(original):
    def stage_compute_times(model, hardware, num_stages, micro_batch_size, recompute):
        forwards, backwards = original(model, hardware, num_stages, micro_batch_size, recompute)
        mode = cost_terms.recompute_mode(recompute)
        extra = [elementwise_bytes(model, micro_batch_size, num_stages, s, mode)
                 for s in range(num_stages)]
        return (tuple(f + e[0] / P100_MEMORY_BANDWIDTH for f, e in zip(forwards, extra)),
                tuple(b + e[1] / P100_MEMORY_BANDWIDTH for b, e in zip(backwards, extra)))
    return stage_compute_times


#: Check 6: CPython's default thread switch interval (``sys.getswitchinterval()``), the
#: longest a thread waiting for the GIL waits before the holder is asked to drop it.
CPYTHON_SWITCH_INTERVAL = 5e-3


def with_p2p_handoff(delay):
    """Check 6: ``timing.p2p_time`` with ``delay`` seconds added to every message (a
    context manager; 0 is the shipped model)."""
    original = cost_terms.p2p_time
    return mock.patch.object(timing, "p2p_time",
                             lambda hardware, size: original(hardware, size) + delay)


def recomputation_profile(whole_stage: bool, last_stage_kept: tuple = (), base=None):
    """Checks 7, 11, 12: ``base`` (default the shipped ``P100_ARIES``) with recomputation
    re-running the whole stage or the layers only (``HardwareSpec.recompute_whole_stage``) and
    the schedule-backed schemes whose last stage never recomputes (``last_stage_kept``). The
    shipped profile is ``(True, ("1f1b",))`` since 2026-12-02 (check 12); ``(False, ())`` is the
    model before it (Megatron's full recomputation on every stage)."""
    return dataclasses.replace(rp.P100_ARIES if base is None else base,
                               recompute_whole_stage=whole_stage,
                               last_stage_kept=tuple(last_stage_kept))


#: Check 8: tensors per stage sync in the authors' ``grads_sync`` (D = 8 ... 64).
SPLIT_SYNC_MIDDLE, SPLIT_SYNC_END = 3, 4


def split_sync_tensors(model, num_stages, stage) -> int:
    """Check 8: all-reduces the authors' ``grads_sync`` issues for one stage's gradient."""
    return SPLIT_SYNC_END if stage in (0, num_stages - 1) else SPLIT_SYNC_MIDDLE


def _predict_split_sync(hardware, run):
    """Check 8: the shipped prediction with each schedule-backed stage sync split into
    :func:`split_sync_tensors` all-reduces (the extra ones add only their latency)."""
    result = rp.estimate(hardware, run)
    if run.scheme in ANALYTIC_SCHEMES:
        return result.throughput
    replicas = num_replicas(run.scheme, run.data_parallel, run.pipeline)
    extra = tuple(time + (split_sync_tensors(rp.GPT2_PAPER, run.pipeline, stage) - 1)
                  * 2 * (replicas - 1) * hardware.alpha
                  for stage, time in enumerate(result.costs.allreduce))
    costs = dataclasses.replace(result.costs, allreduce=extra)
    _, count = schedule_microbatches(run.scheme, run.pipeline, run.micro_batch_size,
                                     run.num_microbatches)
    period = timing.simulated_iteration_time(run.scheme, run.pipeline, count, costs)
    return run.global_batch_size / period


def check_split_sync() -> list:
    """Check 8: refitted in-sample, and the weak scaling from one fit without both of its end
    points."""
    lines, _ = _refit_lines("8. Each stage sync split into 3-4 all-reduces (the authors' "
                            "grads_sync)", _predict_split_sync)
    with mock.patch.object(rp, "predict", _predict_split_sync):
        left_out = rp.WEAK_SCALING_HELD_OUT["end points"]
        fitted = rp.fit(tuple(r for r in rp.FIT_POINTS if r.label not in left_out), START,
                        rp.P100_ARIES, 30, {})
        hardware = rp.hardware_of(fitted)
        held_out = rp.weak_scaling_ratio(hardware, hardware)
    lines.append(f"   weak scaling held out as a pair (one fit without both end points): "
                 f"{held_out:.1%}")
    return lines


def ddp_allreduce_costs(hardware, result):
    """Check 9: ``result.costs`` with each stage's all-reduce run as DistributedDataParallel
    runs it (25 MiB buckets, each paying the ring's latency), contended by the whole job
    (``allreduce``) and alone on the network (``allreduce_alone``)."""
    costs = result.costs
    replicas = num_replicas(result.scheme, result.data_parallel, result.pipeline)
    nodes = result.data_parallel * result.pipeline

    def times(contention):
        return tuple(cost_terms.allreduce_time(hardware, replicas, size, contention,
                                               cost_terms.ddp_buckets(size))
                     for size in costs.gradient_bytes)
    return dataclasses.replace(
        costs, allreduce=times(cost_terms.network_contention(hardware, nodes)),
        allreduce_alone=times(cost_terms.network_contention(hardware, nodes, replicas)))


def gpipe_syncing_every_backward(run, costs) -> float:
    """Check 9: the iteration time of GPipe when every backward all-reduces its stage under
    DDP (:func:`baselines.ddp_backward_with_sync`, blocking the rank), the optimizer step once
    after the flush: the simulator's run of the lowered GPipe plan with those backwards and
    no end-of-iteration sync."""
    stages = range(run.pipeline)
    synced = dataclasses.replace(
        costs, stage_backward=tuple(baselines.ddp_backward_with_sync(costs, s) for s in stages),
        allreduce=tuple(0.0 for _ in stages))
    _, count = schedule_microbatches(run.scheme, run.pipeline, run.micro_batch_size,
                                     run.num_microbatches)
    return timing.simulated_iteration_time(run.scheme, run.pipeline, count, synced)


def one_f_one_b_flush_under_ddp(run, costs, alone: bool) -> float:
    """Check 9: the iteration time of 1F1B with a flush whose last backward per stage
    all-reduces under DDP, blocking the rank before it sends its input gradient (the replay
    of :func:`baselines.no_flush_interval_time` over one update interval of N micro-batches:
    D − s − 1 warm-up forwards, one forward and one backward, the cool-down backwards).
    ``alone``: each stage's sync without the rest of the job's contention (the syncs then
    follow one another down the pipeline, as PipeDream-2BW's do)."""
    _, count = schedule_microbatches(run.scheme, run.pipeline, run.micro_batch_size,
                                     run.num_microbatches)
    return baselines.no_flush_interval_time(run.pipeline, count, costs, intervals=1,
                                            staggered_syncs=alone)


def check_published_flush_paths(hardware) -> list:
    """Check 9: the flushed baselines run as each published code path would run them."""
    runs = {run.label: run for run in paper.COMPARISON_2048}
    gpipe, one_f_one_b = runs["GPipe"], runs["1F1B/DAPPLE"]
    lines = ["9. The published code paths for GPipe and 1F1B (in-sample constants, seq/s)"]
    result = rp.estimate(hardware, gpipe)
    every = gpipe.global_batch_size / gpipe_syncing_every_backward(
        gpipe, ddp_allreduce_costs(hardware, result))
    lines.append(f"   GPipe D={gpipe.pipeline}, published {gpipe.published:.0f}: GEMS main "
                 f"--gpipe (one blocking all-reduce per stage after the flush, as the shipped "
                 f"model) {result.throughput:.1f}; PipeDream-2BW runtime --gpipe (DDP, every "
                 f"backward all-reduces) {every:.1f}")
    result = rp.estimate(hardware, one_f_one_b)
    ddp = ddp_allreduce_costs(hardware, result)
    contended, alone = (one_f_one_b.global_batch_size
                        / one_f_one_b_flush_under_ddp(one_f_one_b, ddp, flag)
                        for flag in (False, True))
    lines.append(f"   1F1B D={one_f_one_b.pipeline}, published {one_f_one_b.published:.0f}: "
                 f"the shipped model {result.throughput:.1f}; PipeDream-2BW runtime's "
                 f"1F1B-with-flush loop (DDP in the last backward, blocking) {contended:.1f} "
                 f"with the job's contention, {alone:.1f} with each stage's sync alone")
    flushed = {run.label: _predict_bucketed_flush_syncs(hardware, run)
               for run in (one_f_one_b, gpipe)}
    lines.append(f"   neither path, for scale: one sync per stage after the flush but through "
                 f"DDP's 25 MiB buckets: 1F1B {flushed[one_f_one_b.label]:.1f}, GPipe "
                 f"{flushed[gpipe.label]:.1f} (1F1B / GPipe "
                 f"{flushed[one_f_one_b.label] / flushed[gpipe.label]:.3f}; paper "
                 f"{one_f_one_b.published / gpipe.published:.3f})")
    return lines


FLUSHED_SCHEMES = ("1f1b", "gpipe")


def _predict_bucketed_flush_syncs(hardware, run):
    """Check 9, for scale only (no published code path does it): the shipped prediction with
    GPipe's and 1F1B's end-of-flush stage syncs run through DDP's 25 MiB buckets, each paying
    the ring's latency (:func:`ddp_allreduce_costs`)."""
    result = rp.estimate(hardware, run)
    if run.scheme not in FLUSHED_SCHEMES:
        return result.throughput
    _, count = schedule_microbatches(run.scheme, run.pipeline, run.micro_batch_size,
                                     run.num_microbatches)
    period = timing.simulated_iteration_time(run.scheme, run.pipeline, count,
                                             ddp_allreduce_costs(hardware, result))
    return run.global_batch_size / period


def _held_out_line(labels, start_hardware) -> str:
    """Each labelled point predicted by a fit without it (``rp.predict`` as patched by the
    caller), started from ``start_hardware``'s constants."""
    start = rp.constants_of(start_hardware)
    held_out = {}
    for label in labels:
        fitted = rp.fit(tuple(r for r in rp.FIT_POINTS if r.label != label), start,
                        rp.P100_ARIES, 30, {})
        run = next(r for r in rp.FIT_POINTS if r.label == label)
        held_out[label] = rp.predict(rp.hardware_of(fitted), run)
    return "   leave-one-out: " + ", ".join(f"{label} {value:.1f}"
                                            for label, value in held_out.items())


def _speedup_line(hardware) -> str:
    values = {run.label: rp.predict(hardware, run) for run in paper.COMPARISON_2048}
    chimera = values[paper.COMPARISON_2048[0].label]
    return "   speedups (in-sample): " + ", ".join(
        f"{label} {chimera / values[label]:.2f}x (paper {published:.2f}x)"
        for label, published in paper.PUBLISHED_SPEEDUPS.items())


#: The middle workers' late stage in Chimera with D = 4 (stage D/2): the one sync whose launch
#: the two policies place differently.
MIDDLE_LATE_STAGE = 2
#: Per-ring-step delays printed by check 10 (s): no stated value; for scale.
RING_STEP_DELAYS = (2e-3, 5e-3, 9e-3)


def _bert48(nodes):
    return paper.PaperRun("", "chimera-direct", nodes // 4, 4, 8, 8, "none", 0, "")


def eager_sync_requirement(hardware, published=paper.SYNC_POLICY) -> list:
    """Check 10: per (nodes, published eager-opt / eager ratio), what plain eager sync must cost
    beyond the shipped model's eager iteration for the published ratio to hold: ``need`` = ratio
    × T(eager-opt) − T(eager) (s), and that extra as a delay per ring step of the middle
    workers' late-stage sync (``per_ring_step``, 2(r − 1) steps, r = 2W), as a multiple of that
    sync (``sync_stretch``) and of the backward it overlaps (``sigma``)."""
    rows = []
    for nodes, ratio in published:
        run = _bert48(nodes)
        opt = rp.estimate(hardware, run, rp.BERT48, "eager-opt")
        eager = rp.estimate(hardware, run, rp.BERT48, "eager")
        need = ratio * opt.iteration_time - eager.iteration_time
        steps = 2 * (num_replicas(run.scheme, run.data_parallel, run.pipeline) - 1)
        late = opt.costs.allreduce[MIDDLE_LATE_STAGE]
        backward = opt.costs.backward_of(MIDDLE_LATE_STAGE - 1)
        rows.append({"nodes": nodes, "published": ratio, "eager_opt": opt.iteration_time,
                     "eager": eager.iteration_time, "need": need, "ring_steps": steps,
                     "per_ring_step": need / steps, "sync_stretch": need / late,
                     "sigma": need / backward})
    return rows


def copy_engine_bound(hardware, run) -> float:
    """Check 10: an upper bound on eager-opt / eager from the device's copy engines. A CUDA
    device overlaps a host-to-device with a device-to-host copy, not two copies in the same
    direction (CUDA C Programming Guide, "Concurrent Data Transfers"); gloo stages a CUDA
    all-reduce through pinned host memory (a device-to-host copy of the whole stage gradient at
    launch). With eager sync the other middle worker launches its late-stage sync right after
    the backward whose input gradient the first one needs next (the message it sends then is
    copied out by ``tensor.cpu()``); at worst that message waits for the whole staging copy,
    L / host link bandwidth, and the iteration with it. Stated constants only (PCIe 3.0 x16)."""
    opt = rp.estimate(hardware, run, rp.BERT48, "eager-opt")
    eager = rp.estimate(hardware, run, rp.BERT48, "eager")
    wait = opt.costs.gradient_bytes[MIDDLE_LATE_STAGE] / hardware.host_staging_bandwidth
    return (eager.iteration_time + wait) / opt.iteration_time


def eager_ring_step_delay_ratio(hardware, run, delay) -> float:
    """Check 10: eager-opt / eager when the middle workers' eagerly launched late-stage sync
    pays ``delay`` more per ring step (2(r − 1)·delay; eager-opt launches it after the last
    backward, when nothing overlaps it, so there it pays nothing). Stage D/2's replicas are
    all middle workers, so lengthening that stage's sync in the eager run is exactly this."""
    opt = rp.estimate(hardware, run, rp.BERT48, "eager-opt")
    eager = rp.estimate(hardware, run, rp.BERT48, "eager")
    steps = 2 * (num_replicas(run.scheme, run.data_parallel, run.pipeline) - 1)
    syncs = list(eager.costs.allreduce)
    syncs[MIDDLE_LATE_STAGE] += steps * delay
    costs = dataclasses.replace(eager.costs, allreduce=tuple(syncs))
    _, count = schedule_microbatches(run.scheme, run.pipeline, run.micro_batch_size,
                                     run.num_microbatches)
    slowed = timing.simulated_iteration_time(run.scheme, run.pipeline, count, costs, "eager")
    return slowed / opt.iteration_time


def check_eager_sync_requirement(hardware) -> list:
    lines = ["10. The sync-policy ratio read backwards (Bert-48 D=4 B=8 N=8, in-sample "
             "constants): extra time plain eager must cost"]
    for row in eager_sync_requirement(hardware):
        lines.append(
            f"   {row['nodes']} nodes (paper {row['published']:.2f}x): eager-opt "
            f"{row['eager_opt']:.3f} s, eager {row['eager']:.3f} s, needs +{row['need']:.3f} s ="
            f" {row['per_ring_step'] * 1e3:.1f} ms per ring step ({row['ring_steps']} steps),"
            f" {row['sync_stretch']:.2f}x the late-stage sync, sigma {row['sigma']:.2f}")
    for spread in (-0.02, 0.02):
        shifted = tuple((nodes, ratio + spread) for nodes, ratio in paper.SYNC_POLICY)
        lines.append(f"   published ratios {spread:+.2f} (read-off uncertainty), ms per ring "
                     "step: " + ", ".join(f"{row['nodes']} nodes "
                                          f"{row['per_ring_step'] * 1e3:.1f}" for row in
                                          eager_sync_requirement(hardware, shifted)))
    lines.append("   copy-engine bound (stated constants): " + ", ".join(
        f"{nodes} nodes {copy_engine_bound(hardware, _bert48(nodes)):.3f}"
        for nodes, _ in paper.SYNC_POLICY))
    for delay in RING_STEP_DELAYS:
        lines.append(f"   per-ring-step delay {delay * 1e3:.0f} ms on the overlapped sync: " + ", ".join(
            f"{nodes} nodes {eager_ring_step_delay_ratio(hardware, _bert48(nodes), delay):.3f}"
            f" (paper {published:.2f})" for nodes, published in paper.SYNC_POLICY))
    return lines


def last_stage_memory_without_recompute(hardware, run) -> float:
    """Check 11: bytes on ``run``'s last pipeline rank if it kept the full activations of every
    micro-batch it holds at its peak (read off the lowered plan), as the shipped model counts
    a run without recomputation."""
    return rp.estimate(hardware, dataclasses.replace(run, recompute="none")).memory_per_worker[-1]


def held_out_summary(data) -> dict:
    """Check 11: from a ``rp.report`` dict, the numbers the issue's targets read (leave-one-out
    speedups, order, weak scaling) and the RMS log error of the leave-one-out predictions."""
    errors = [math.log(point["leave_one_out"] / point["published"]) for point in data["points"]]
    return {"speedups": {label: row["leave_one_out"] for label, row in data["speedups"].items()},
            "order": data["order_2048"]["leave_one_out"],
            "weak_scaling": data["weak_scaling_efficiency"]["leave_one_out"],
            "sweep_best": data["sweep_best"]["leave_one_out"],
            "loo_rms_log_error": math.sqrt(sum(e * e for e in errors) / len(errors)),
            "points": {point["label"]: point["leave_one_out"] for point in data["points"]}}


def _summary_lines(summary) -> list:
    return [
        "   leave-one-out: " + ", ".join(f"{label} {value:.1f}"
                                         for label, value in summary["points"].items()),
        "   leave-pair-out speedups: " + ", ".join(
            f"{label} {value:.3f}x ({value / paper.PUBLISHED_SPEEDUPS[label] - 1:+.1%})"
            for label, value in summary["speedups"].items()),
        f"   order: {' > '.join(summary['order'])}; weak scaling (end points held out) "
        f"{summary['weak_scaling']:.2%}; sweep best {summary['sweep_best']}; RMS log error of "
        f"the leave-one-out predictions {summary['loo_rms_log_error']:.4f}"]


def _refit_summary(base) -> tuple:
    """Every fit of the report recomputed on the profile ``base`` (in-sample, leave-one-out,
    leave-pair-out, weak scaling held out; about a minute): (in-sample fit,
    :func:`held_out_summary`)."""
    fits = rp.compute_fits(base)
    fits["planner"] = rp.load_fits().get("planner", {})
    return fits["in_sample"], held_out_summary(rp.report(fits, base))


def _fit_line(title, in_sample) -> str:
    return (f"   {title}: in-sample efficiency {in_sample['efficiency']:.3f}, "
            f"{in_sample['bandwidth'] / 1e9:.2f} GB/s, γ "
            f"{in_sample['global_bandwidth_fraction']:.3f}, RMS log error "
            f"{in_sample['rms_log_error']:.4f}")


def check_recomputation(hardware) -> list:
    """Checks 11 and 12: the memory of a last stage that keeps its activations, then the
    report's held-out numbers for the model before 2026-12-02 (layers only, every stage),
    check 11 alone (1F1B's last stage kept, layers only elsewhere) and the shipped model
    (check 12: whole stages, 1F1B's last stage kept; the stored fits)."""
    runs = {run.label: run for run in paper.COMPARISON_2048}
    memory = ", ".join(
        f"{label} {last_stage_memory_without_recompute(hardware, runs[label]) / 1e9:.1f} GB"
        for label in ("1F1B/DAPPLE", "GPipe"))
    lines = [f"11/12. Last stage without recomputation (device 16 GB): {memory}"]
    for title, base in (("before 2026-12-02 (layers only, every stage)",
                         recomputation_profile(False)),
                        ("check 11 alone (1F1B's last stage kept, layers only elsewhere)",
                         recomputation_profile(False, ("1f1b",)))):
        in_sample, summary = _refit_summary(base)
        lines += [_fit_line(title + ", every fit recomputed", in_sample)] + _summary_lines(
            summary)
    stored = rp.load_fits()
    lines += ([_fit_line("shipped (check 12: whole stages, 1F1B's last stage kept; stored fits)",
                         stored["in_sample"])]
              + _summary_lines(held_out_summary(rp.report(stored))))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-slow", action="store_true", help="only checks 1, 2, 9 and 10")
    args = parser.parse_args(argv)
    hardware = rp.hardware_of(rp.load_fits()["in_sample"])
    out = (check_steady_state(hardware) + check_head_of_line(hardware)
           + check_published_flush_paths(hardware) + check_eager_sync_requirement(hardware))
    if not args.skip_slow:
        lines, _ = _refit_lines("0. The shipped model (for comparison)")
        out += lines
        lines, _ = _refit_lines("3. Time-varying contention", _predict_contended)
        out += lines
        with mock.patch.object(timing, "stage_compute_times",
                               _with_elementwise(timing.stage_compute_times)):
            lines, _ = _refit_lines("4. Element-wise memory traffic")
        out += lines
        base = dataclasses.replace(rp.P100_ARIES, op_overhead_seconds=2e-3)
        lines, overhead_hw = _refit_lines("5. Per-op overhead 2 ms (a fourth constant)",
                                          base=base)
        top = rp.planner_top(overhead_hw, top=1)[0]
        lines.append(f"   planner's first choice there: {top.scheme} W={top.data_parallel} "
                     f"D={top.pipeline} B={top.micro_batch_size} recompute={top.recompute} "
                     f"{top.throughput:.0f} seq/s")
        out += lines
        for delay in (2e-3, CPYTHON_SWITCH_INTERVAL):
            with with_p2p_handoff(delay):
                lines, handoff_hw = _refit_lines(
                    f"6. Point-to-point hand-off delay {delay * 1e3:.0f} ms per message")
                lines.append(_speedup_line(handoff_hw))
            out += lines
        whole_only = recomputation_profile(True)
        at_shipped = rp.hardware_of(rp.constants_of(hardware), whole_only)
        fixed = ["7. Whole-stage recomputation alone (1F1B's last stage recomputing too), at the "
                 "shipped constants: " + ", ".join(
                     f"{run.label} {rp.predict(at_shipped, run):.1f}"
                     for run in rp.FIT_POINTS if run.recompute == "full")]
        lines, recompute_hw = _refit_lines("7. Whole-stage recomputation alone, refitted",
                                           base=whole_only)
        lines.append(_speedup_line(recompute_hw))
        out += fixed + lines
        out += check_split_sync()
        lines, bucketed_hw = _refit_lines("9. GPipe's and 1F1B's end-of-flush syncs through DDP's "
                                          "buckets (no published path), refitted",
                                          _predict_bucketed_flush_syncs)
        with mock.patch.object(rp, "predict", _predict_bucketed_flush_syncs):
            lines.append(_speedup_line(bucketed_hw))
            lines.append(_held_out_line(("1F1B/DAPPLE", "GPipe", "W=16 D=32",
                                         "W=64 D=8 recompute"), bucketed_hw))
        out += lines
        out += check_recomputation(hardware)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
