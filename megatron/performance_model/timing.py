"""Iteration time of schedule-backed schemes: the paper's closed form and the simulated
lowered schedule, both with all-reduces that share each rank's link."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from megatron.core.pipeline_parallel.planning.instructions import Instruction
from megatron.core.pipeline_parallel.planning.lowering import GradSyncStart, GradSyncWait
from megatron.core.pipeline_parallel.planning.simulator import simulate
from megatron.performance_model.costs import (
    StageCosts, allreduce_time, compute_times, ddp_buckets, network_contention, optimizer_step_time,
    overlap_delay,
    p2p_time, recompute_flops, shared_link_finish_times, stage_compute_times, stage_parameters)
from megatron.core.pipeline_parallel.planning.op_costs import StageCosts as OpStageCosts
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleRegistry
from megatron.performance_model.schemes import (
    ANALYTIC_SCHEMES, DDP_SCHEMES, critical_path, last_stage_kept, lowered_schedule, model_stages,
    num_replicas, scheme_layout)
from megatron.performance_model.specs import HardwareSpec, ModelSpec


def stage_costs(model: ModelSpec, hardware: HardwareSpec, scheme: str, data_parallel: int,
                num_stages: int, micro_batch_size: int, recompute,
                stage_balance: str = "balanced",
                registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> StageCosts:
    """F, Bk (:func:`compute_times`) of one model stage, Cp2p of one activation message, each
    model stage's all-reduce time over the scheme's replicas (slowed by the contention of the
    job's W·D nodes syncing at once, :func:`network_contention`; ``allreduce_alone``: the same
    when only one stage's replicas sync) and the hardware's overlap slowdown σ. Model stages: D,
    or D x chunks per rank (interleaved 1F1B: each op runs one chunk of L / (D v) layers).
    ``stage_balance="per-stage"``: each model stage's own F and Bk as well (the last one runs
    the output layer); ``forward``/``backward`` are then their means (for the closed form)."""
    stages = model_stages(scheme, num_stages, registry)
    forward, backward = compute_times(model, hardware, stages, micro_batch_size, recompute,
                                      stage_balance)
    message = micro_batch_size * model.seq_length * model.hidden_size * model.bytes_per_value
    replicas = num_replicas(scheme, data_parallel,
                            None if scheme in ANALYTIC_SCHEMES else num_stages, registry)
    gradient_bytes = tuple(stage_parameters(model, stages, stage) * model.bytes_per_value
                           for stage in range(stages))
    contention = network_contention(hardware, data_parallel * num_stages)
    messages = [ddp_buckets(size) if scheme in DDP_SCHEMES else 1 for size in gradient_bytes]
    allreduce = tuple(allreduce_time(hardware, replicas, size, contention, count)
                      for size, count in zip(gradient_bytes, messages))
    alone = network_contention(hardware, data_parallel * num_stages, replicas)
    allreduce_alone = tuple(allreduce_time(hardware, replicas, size, alone, count)
                            for size, count in zip(gradient_bytes, messages))
    # The authors' PipeDream runtime passes recompute_step = args.recompute_step and stage !=
    # num_stages - 1 (main_with_runtime.py): its last stage keeps its activations and skips
    # the recomputed forward (the one with the most FLOPs, so ``slowest`` is that stage).
    # So does the 1F1B-scheduled loop of the authors' PipeDream-2BW main for any scheme in
    # ``hardware.last_stage_kept``.
    skipped = 0.0
    if last_stage_kept(scheme, hardware) and stages > 1:
        skipped = (recompute_flops(model, stages, micro_batch_size, recompute, stages - 1,
                                   hardware.recompute_whole_stage)
                   / hardware.sustained_rate(micro_batch_size * model.seq_length))
        backward -= skipped / stages if stage_balance == "balanced" else skipped
    stage_forward = stage_backward = ()
    if stage_balance == "per-stage":
        stage_forward, stage_backward = stage_compute_times(model, hardware, stages,
                                                            micro_batch_size, recompute)
        if skipped:
            stage_backward = stage_backward[:-1] + (stage_backward[-1] - skipped,)
        forward, backward = (sum(stage_forward) / stages, sum(stage_backward) / stages)
    optimizer = tuple(optimizer_step_time(hardware, size / model.bytes_per_value)
                      for size in gradient_bytes)
    return StageCosts(forward, backward, p2p_time(hardware, message) if num_stages > 1 else 0.0,
                      allreduce, gradient_bytes, hardware.overlap_slowdown, stage_forward,
                      stage_backward, allreduce_alone, optimizer)


def critical_path_counts(scheme: str, num_stages: int, num_microbatches: int,
                         registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """(Cf, Cb): forwards and backwards of one model stage on the critical path, or None where
    no closed form is known here: the family record's ``critical_path`` hook.

    Chimera direct (2 pipelines), N = K·D: Cf = 2K + D − 2, Cb = K(2D − 2) (chimera.md §4);
    2f pipelines, N = D: Cf = D, Cb = D + D/f − 2. 1F1B and GPipe: Cf = Cb = N + D − 1.
    Interleaved 1F1B with v chunks: N v + D − 1 chunk ops each. Otherwise None (simulate).
    """
    return critical_path(scheme, num_stages, num_microbatches, registry)


def exposed_allreduce(scheme: str, num_stages: int, costs: StageCosts,
                      grad_sync_policy: str = "eager-opt",
                      registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> list:
    """Closed-form all-reduce time each worker cannot hide (list over pipeline ranks), from the
    scheme's layout.

    Two mirrored pipelines (2-pipeline Chimera): worker r hosts its early stage
    e = min(r, D−1−r) and its late stage D−1−e. The early stage's sync starts after the last
    backward. With eager sync the late stage's starts a = D/2 − e backwards earlier and runs
    alone for a·Bk (idle gaps ignored: conservative); what is left of it then shares the link
    with the early stage's sync, so the two finish after their sum
    (:func:`shared_link_finish_times`). eager-opt does not start it early on the two middle
    workers (a = 1), ``end`` on none. The backwards under an eager sync run σ slower
    (``costs.overlap_slowdown``; idle gaps that would absorb it are ignored here too).
    One pipeline: every stage a worker hosts (v chunks for interleaved 1F1B) syncs at the end,
    sharing the link. More pipelines (2f > 2): the largest sync times the pipelines.
    """
    d = num_stages
    layout = scheme_layout(scheme, num_stages, registry)
    if layout.num_pipelines == 1:
        return [sum(costs.allreduce[stage] for _, stage in layout.hosted(rank))
                for rank in range(d)]
    if layout.num_pipelines > 2:
        return [max(costs.allreduce) * layout.num_pipelines] * d
    exposed = []
    for rank in range(d):
        early = min(rank, d - 1 - rank)
        remaining = d // 2 - early
        eager = grad_sync_policy == "eager" or (grad_sync_policy == "eager-opt" and remaining > 1)
        hidden = remaining * costs.backward if eager else 0.0
        late = costs.allreduce[d - 1 - early]
        exposed.append(costs.allreduce[early] + max(0.0, late - hidden)
                       + costs.overlap_slowdown * min(late, hidden))
    return exposed


def closed_form_iteration_time(scheme: str, num_stages: int, num_microbatches: int,
                               costs: StageCosts, grad_sync_policy: str = "eager-opt",
                               registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """T = (F + Cp2p)·Cf + (Bk + Cp2p)·Cb + max_r exposed all-reduce, or None (no counts)."""
    counts = critical_path_counts(scheme, num_stages, num_microbatches, registry)
    if counts is None:
        return None
    forward_count, backward_count = counts
    return ((costs.forward + costs.p2p) * forward_count
            + (costs.backward + costs.p2p) * backward_count
            + max(exposed_allreduce(scheme, num_stages, costs, grad_sync_policy, registry))
            + max(sum(costs.optimizer_step_of(stage) for _, stage in
                      scheme_layout(scheme, num_stages, registry).hosted(rank))
                  for rank in range(num_stages)))


def simulated_iteration_time(scheme: str, num_stages: int, num_microbatches: int,
                             costs: StageCosts, grad_sync_policy: str = "eager-opt",
                             registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> float:
    """Makespan of the lowered schedule with F, Bk (per stage where ``costs`` has them), Cp2p
    and the stages' all-reduces.

    The simulator runs with all-reduce cost 0. A stage's sync can progress once its last
    replica has started it; on each rank the syncs of the stages it hosts share the link
    (:func:`shared_link_finish_times`); a stage's sync ends when it has on all its ranks, and a
    worker ends when its compute and its syncs have. Compute overlapped by a rank's in-flight
    syncs is slowed by σ (:func:`overlap_delay`); the largest delay that a rank's idle time
    cannot absorb is added (the stretched ops are in the coupled tail of the schedule).
    """
    result = compute_timelines(scheme, num_stages, num_microbatches, costs, grad_sync_policy,
                               registry)
    ready, ranks = sync_ready_times(result)
    stage_end, windows = {}, []
    for rank in ranks:
        finishes = shared_link_finish_times([(ready[s], costs.allreduce[s]) for s in rank.stages])
        windows.append([(ready[s], finish) for s, finish in zip(rank.stages, finishes)])
        for stage, finish in zip(rank.stages, finishes):
            stage_end[stage] = max(stage_end.get(stage, 0.0), finish)
    layout, _ = lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy,
                                 registry)
    makespan = max(max([rank.end] + [stage_end[s] for s in rank.stages])
                   + sum(costs.optimizer_step_of(stage) for _, stage in layout.hosted(index))
                   for index, rank in enumerate(ranks))
    delays = [overlap_delay([(e.start, e.end) for e in timeline if isinstance(e.op, Instruction)],
                            rank_windows, costs.overlap_slowdown)
              for timeline, rank_windows in zip(result.timelines, windows)]
    return makespan + max(delays, default=0.0)


@dataclass(frozen=True)
class RankCompute:
    """One rank of a simulated iteration (all-reduce cost 0): the stages whose syncs it starts,
    in order, the end of its last compute op and the start of its first instruction."""

    stages: tuple
    end: float
    first: float


def compute_timelines(scheme: str, num_stages: int, num_microbatches: int, costs: StageCosts,
                      grad_sync_policy: str = "eager-opt",
                      registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """The simulator's run of the lowered schedule with ``costs``' F, Bk, Cp2p (per stage where
    it has them) and all-reduce cost 0 (cached, see :func:`_cached_timelines`)."""
    return _cached_timelines(scheme, num_stages, num_microbatches, grad_sync_policy, registry,
                             costs.forward, costs.backward, costs.p2p, costs.stage_forward,
                             costs.stage_backward)


def sync_ready_times(result) -> tuple[dict, list[RankCompute]]:
    """From :func:`compute_timelines`' result: when each stage's sync can start (its last
    replica's ``GradSyncStart``) and every rank's :class:`RankCompute`."""
    ready, ranks = {}, []
    for timeline in result.timelines:
        stages, end, first = [], 0.0, math.inf
        for entry in timeline:
            if isinstance(entry.op, GradSyncStart):
                ready[entry.op.stage] = max(ready.get(entry.op.stage, 0.0), entry.start)
                stages.append(entry.op.stage)
            elif not isinstance(entry.op, GradSyncWait):
                end = max(end, entry.end)
                if isinstance(entry.op, Instruction):
                    first = min(first, entry.start)
        ranks.append(RankCompute(tuple(stages), end, 0.0 if first == math.inf else first))
    return ready, ranks


@lru_cache(maxsize=128)
def _cached_timelines(scheme, num_stages, num_microbatches, grad_sync_policy, registry,
                      forward, backward, p2p, stage_forward, stage_backward):
    """The simulator's run of the lowered schedule (all-reduce cost 0), cached per
    configuration and compute/p2p costs: the all-reduce terms (bandwidth, contention) do not
    change it, so fits that vary only those reuse it."""
    _, lowered = lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy,
                                  registry)
    per_stage = None
    if stage_forward:
        per_stage = OpStageCosts(len(stage_forward), forward, backward,
                                 per_stage={stage: (f, b / 2, b / 2) for stage, (f, b) in
                                            enumerate(zip(stage_forward, stage_backward))})
    return simulate([list(ops) for ops in lowered], forward, backward, p2p, 0,
                    stage_costs=per_stage)
