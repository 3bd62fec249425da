"""GEMS, PipeDream and PipeDream-2BW: the paper's baselines that this project's runtime does
not run, modelled analytically from their published schedules (paper Table 2).

Each returns (iteration time, memory per pipeline rank). All charge one Cp2p per compute op
as the paper's closed form does, and use the same F, Bk, all-reduce and memory terms as the
schedule-backed schemes (:mod:`megatron.performance_model.costs`).
"""

from __future__ import annotations

from megatron.performance_model.costs import StageCosts, activation_bytes
from megatron.performance_model.memory import state_bytes, working_bytes
from megatron.performance_model.specs import HardwareSpec, ModelSpec


def gems_time(num_stages: int, num_microbatches: int, costs: StageCosts) -> float:
    """GEMS: two mirrored replicas, one micro-batch in flight per replica. Per pair of
    micro-batches each worker does 2(F + Bk) of work at the bubble ratio (D−1)/(D+1/2) of
    Table 2, so a pair takes 2(F+Bk)·(D+1/2)/(3/2); the two hosted stages sync at the end,
    sharing the link (their all-reduce times add)."""
    d = num_stages
    work = costs.forward + costs.backward + 2 * costs.p2p
    pair = 2 * work * (d + 0.5) / 1.5
    exposed = max(costs.allreduce[s] + costs.allreduce[d - 1 - s] if d > 1 else costs.allreduce[0]
                  for s in range(d))
    return num_microbatches // 2 * pair + exposed


def pipedream_time(num_stages: int, num_microbatches: int, costs: StageCosts) -> float:
    """PipeDream (asynchronous 1F1B, weight stashing, no flush): the steady state runs one
    F and one Bk per micro-batch with no bubble; the stage's replicas all-reduce after every
    micro-batch before the weight update the next one uses, so that sync is exposed."""
    per_microbatch = costs.forward + costs.backward + 2 * costs.p2p + max(costs.allreduce)
    return num_microbatches * per_microbatch


def pipedream_2bw_time(num_stages: int, num_microbatches: int, costs: StageCosts,
                       drains_each_step: bool = False) -> float:
    """PipeDream-2BW (1F1B without flush, two weight versions, gradients accumulated over the
    N micro-batches): no bubble; the once-per-iteration all-reduce overlaps the next
    iteration's N(F + Bk) (the update is applied one step late), so only its excess shows.
    The overlapped compute is not free: with no bubble to absorb it, every second of compute
    under the sync costs σ more (``costs.overlap_slowdown``, the term that makes eager sync
    lose to eager-sync-opt in the paper).

    ``drains_each_step``: a diagnostic, not Table 2's scheme: an implementation whose training
    step runs a complete schedule (fill and drain, as a step-bounded pipeline engine does) pays
    1F1B's (N + D − 1) slots per step while keeping 2BW's delayed, overlapped sync."""
    slots = num_microbatches + (num_stages - 1 if drains_each_step else 0)
    work = num_microbatches * (costs.forward + costs.backward)
    compute = slots * (costs.forward + costs.backward + 2 * costs.p2p)
    sync = max(costs.allreduce)
    return compute + max(0.0, sync - work) + costs.overlap_slowdown * min(sync, work)


def baseline_memory(model: ModelSpec, hardware: HardwareSpec, scheme: str, num_stages: int,
                    micro_batch_size: int, recompute, replicas: int) -> list:
    """Memory per rank. GEMS: both mirrored stages, one stored micro-batch each. PipeDream:
    rank r stashes D − r weight versions and D − r micro-batches (1F1B in flight).
    PipeDream-2BW: two weight versions, D − r micro-batches."""
    stored = activation_bytes(model, micro_batch_size, num_stages, recompute)
    memory = []
    for rank in range(num_stages):
        if scheme == "gems":
            stages, versions, in_flight = sorted({rank, num_stages - 1 - rank}), 1, 2
        elif scheme == "pipedream":
            stages, versions, in_flight = [rank], num_stages - rank, num_stages - rank
        elif scheme == "pipedream-2bw":
            stages, versions, in_flight = [rank], 2, num_stages - rank
        else:
            raise ValueError(f"{scheme!r} is not an analytic baseline")
        memory.append(state_bytes(model, hardware, num_stages, stages, replicas,
                                  weight_versions=versions)
                      + in_flight * stored + hardware.framework_overhead_bytes
                      + working_bytes(model, num_stages, micro_batch_size, recompute,
                                      num_stages - 1 in stages))
    return memory


BASELINE_TIMES = {"gems": gems_time, "pipedream": pipedream_time,
                  "pipedream-2bw": pipedream_2bw_time}
