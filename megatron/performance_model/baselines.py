"""GEMS, PipeDream and PipeDream-2BW: the paper's baselines that this project's runtime does
not run, modelled analytically from how the authors' implementations execute them
(github.com/Shigangli/Chimera, branch ChimeraBk, ``baselines/gpt2_*``).

Each time function returns the iteration time of one pipeline replica for N micro-batches;
the memory function returns bytes per pipeline rank (paper Table 2). They use the same F, Bk,
Cp2p and all-reduce terms as the schedule-backed schemes
(:mod:`megatron.performance_model.costs`); a compute op pays one Cp2p for its input message.

What each implementation does, read off the authors' code:

* PipeDream-2BW (``main_with_runtime.py`` without ``--pipedream``): 1F1B without a flush;
  ``update_interval = D × gradient_accumulation_steps`` micro-batches per weight update, two
  weight versions (``AdamWWithStashingAndAggregation``). Data parallelism is
  ``DistributedDataParallel`` under ``no_sync()`` except for the last backward of each update
  interval, whose all-reduce therefore runs inside that backward, blocking the rank, before
  ``optimizer.step()``: no bubble to hide it in, nothing asynchronous. With
  ``--recompute_step`` every stage but the last recomputes (``recompute_step =
  args.recompute_step and r.stage != (r.num_stages - 1)``; the same for PipeDream).
* PipeDream (``--pipedream``): ``update_interval = 1``: every micro-batch's backward
  all-reduces and updates the weights; rank r stashes ``num_warmup_minibatches + 1 = D − r``
  weight versions (``AdamWWithStashing``).
* GEMS (``main_with_runtime_gems.py``): two mirrored replicas on the same D workers; every
  step runs one micro-batch of the down replica through forward and backward, then one of the
  up replica (``r.run_forward; r.run_backward; r_reverse.run_forward; r_reverse.run_backward``),
  so each replica has one micro-batch in flight; both replicas' syncs at the update.
"""

from __future__ import annotations

from megatron.performance_model.costs import DDP_BUCKET_BYTES, StageCosts, activation_bytes
from megatron.performance_model.memory import state_bytes, working_bytes
from megatron.performance_model.schemes import LAST_STAGE_NOT_RECOMPUTED
from megatron.performance_model.specs import HardwareSpec, ModelSpec


def gems_step_time(num_stages: int, costs: StageCosts) -> float:
    """One GEMS step (one down and one up micro-batch) in steady state, by replaying the
    authors' per-worker order [F_down, B_down, F_up, B_up] with its dependencies: a forward of
    stage s needs stage s−1's forward, a backward of stage s needs stage s+1's backward; the
    down replica's stage s is on worker s, the up replica's on D−1−s. Each op holds its rank
    for its compute plus one Cp2p (its message exchange, as the simulator's blocking p2p).
    Returns the period between the starts of consecutive steps on worker 0 (three steps are
    replayed so the period is the steady one)."""
    d, c = num_stages, costs.p2p
    f = [costs.forward_of(stage) + c for stage in range(d)]  # by stage, with its exchange
    b = [costs.backward_of(stage) + c for stage in range(d)]
    free = [0.0] * d  # when each worker is free
    starts = []
    for _ in range(3):
        starts.append(None)
        down_f, down_b, up_f, up_b = [0.0] * d, [0.0] * d, [0.0] * d, [0.0] * d
        for s in range(d):  # down forward, worker s
            ready = free[s] if s == 0 else max(free[s], down_f[s - 1])
            if s == 0:
                starts[-1] = ready
            down_f[s] = ready + f[s]
            free[s] = down_f[s]
        for s in reversed(range(d)):  # down backward on worker s, then the up forward there
            ready = free[s] if s == d - 1 else max(free[s], down_b[s + 1])
            down_b[s] = ready + b[s]
            free[s] = down_b[s]
            worker, stage = s, d - 1 - s  # up stage on this worker
            ready = free[worker] if stage == 0 else max(free[worker], up_f[worker + 1])
            up_f[worker] = ready + f[stage]
            free[worker] = up_f[worker]
        for worker in range(d):  # up backward runs from worker 0 (up's last stage) to D−1
            stage = d - 1 - worker
            ready = free[worker] if stage == d - 1 else max(free[worker], up_b[worker - 1])
            up_b[worker] = ready + b[stage]
            free[worker] = up_b[worker]
    return starts[2] - starts[1]


def gems_time(num_stages: int, num_microbatches: int, costs: StageCosts) -> float:
    """GEMS: N/2 steps (:func:`gems_step_time`), then each worker all-reduces the two stages it
    hosts (s and D−1−s, one per replica), one after the other: their times add; each stage's
    optimizer step follows its sync (``optimizer.step()`` all-reduces, then updates)."""
    d = num_stages
    if num_microbatches % 2:
        raise ValueError(f"gems alternates two replicas: N must be even (got {num_microbatches})")
    exposed = max(sum(costs.allreduce[stage] + costs.optimizer_step_of(stage)
                      for stage in {s, d - 1 - s}) for s in range(d))
    return num_microbatches // 2 * gems_step_time(d, costs) + exposed




def ddp_backward_with_sync(costs: StageCosts, stage: int, alone: bool = False) -> float:
    """Duration of a backward that all-reduces under DistributedDataParallel: gradients are
    bucketed (:data:`DDP_BUCKET_BYTES`) and each bucket's all-reduce starts when its gradients
    are ready, so the sync overlaps the backward; the first bucket is ready after its share of
    the gradient computation, the last one only at the end. The authors' runtime recomputes
    the whole stage's forward before ``torch.autograd.backward`` (``run_backward``:
    ``self._run_forward(tensors, recompute_step=False)`` first), so no gradient, and no
    bucket, exists before that recomputation R = Bk − 2F ends (0 without recomputation and on
    the last stage; with an op overhead o this undercounts R by o). Duration =
    max(Bk + AR of one bucket, R + share of (Bk − R) until the first bucket + AR of the whole
    stage). ``alone``: no other stage syncs at the same time (``costs.allreduce_alone``, no
    network contention from the rest of the job)."""
    backward, allreduce = costs.backward_of(stage), costs.allreduce[stage]
    if alone and costs.allreduce_alone:
        allreduce = costs.allreduce_alone[stage]
    recomputed = min(backward, max(0.0, backward - 2 * costs.forward_of(stage)))
    total = costs.gradient_bytes[stage]
    share = min(1.0, DDP_BUCKET_BYTES / total) if total > 0 else 1.0
    return max(backward + share * allreduce,
               recomputed + share * (backward - recomputed) + allreduce)


def no_flush_interval_time(num_stages: int, update_interval: int, costs: StageCosts,
                           intervals: int = 4, staggered_syncs: bool = False) -> float:
    """Steady-state time of one update interval of 1F1B without a flush (PipeDream's runtime),
    by replaying its dependencies: stage s runs D − s − 1 warm-up forwards, then alternates
    one forward and one backward; a forward needs the previous stage's forward of that
    micro-batch, a backward the next stage's backward; each op holds its rank for its compute
    plus one Cp2p (its message exchange, as the simulator's blocking p2p); the backward of
    the last micro-batch of each update interval all-reduces the stage's gradients inside the
    backward (DDP outside ``no_sync``, :func:`ddp_backward_with_sync`), so the rank is blocked
    until it ends and sends its input gradient only afterwards. Per-stage F and Bk where ``costs`` has them, so the slowest
    stage sets the pace and stalls propagate through the pipeline as they would. Returns the
    time between the ends of two consecutive intervals on stage 0 (the ``intervals``-th and
    the one before). ``staggered_syncs``: the stages' syncs follow one another down the
    pipeline (a stage's sync delays the gradient the previous stage waits for), so each
    all-reduce runs while no other stage's does (``costs.allreduce_alone``)."""
    d, c = num_stages, costs.p2p
    total = update_interval * intervals
    forward_end = [[0.0] * total for _ in range(d)]
    backward_end = [[0.0] * total for _ in range(d)]
    orders = []
    for s in range(d):
        warmup = min(d - s - 1, total)
        order = [("F", j) for j in range(warmup)]
        for j in range(total):
            if warmup + j < total:
                order.append(("F", warmup + j))
            order.append(("B", j))
        orders.append(order)
    position, free = [0] * d, [0.0] * d
    done = [[set(), set()] for _ in range(d)]  # forwards, backwards finished per stage
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s in range(d):
            while position[s] < len(orders[s]):
                kind, j = orders[s][position[s]]
                if kind == "F":
                    if s > 0 and j not in done[s - 1][0]:
                        break
                    ready = max(free[s], forward_end[s - 1][j] if s > 0 else 0.0)
                    forward_end[s][j] = free[s] = ready + costs.forward_of(s) + c
                    done[s][0].add(j)
                else:
                    if s < d - 1 and j not in done[s + 1][1]:
                        break
                    ready = max(free[s], backward_end[s + 1][j] if s < d - 1 else 0.0)
                    end = ready + costs.backward_of(s) + c
                    if j % update_interval == update_interval - 1:
                        end = (ready + ddp_backward_with_sync(costs, s, staggered_syncs) + c
                               + costs.optimizer_step_of(s))
                    backward_end[s][j] = free[s] = end
                    done[s][1].add(j)
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B replay made no progress (a bug in the replay)")
    last = [max(backward_end[s][j] for s in range(d)) for j in range(total)]
    return (last[total - 1] - last[total - 1 - update_interval]) if intervals > 1 else last[-1]


def pipedream_time(num_stages: int, num_microbatches: int, costs: StageCosts) -> float:
    """PipeDream: 1F1B without a flush, and every micro-batch's backward all-reduces and
    updates (update interval 1): N times the steady interval of
    :func:`no_flush_interval_time`."""
    return num_microbatches * no_flush_interval_time(num_stages, 1, costs)


def pipedream_2bw_time(num_stages: int, num_microbatches: int, costs: StageCosts) -> float:
    """PipeDream-2BW: 1F1B without a flush, gradients accumulated locally over the N
    micro-batches of an update; the last backward of the update all-reduces them, blocking
    (DDP outside ``no_sync``) and delaying the input gradient it sends: one steady interval of
    :func:`no_flush_interval_time` with an update interval of N. The syncs of the stages
    follow one another down the pipeline, so each runs while the others do not: without the
    contention of a whole job syncing at once."""
    return no_flush_interval_time(num_stages, num_microbatches, costs, staggered_syncs=True)


def baseline_memory(model: ModelSpec, hardware: HardwareSpec, scheme: str, num_stages: int,
                    micro_batch_size: int, recompute, replicas: int) -> list:
    """Memory per rank (paper Table 2). GEMS: both mirrored stages (2Mθ), one micro-batch in
    flight per worker (Ma: a worker finishes the down micro-batch's backward before the up
    one's forward). PipeDream: rank r stashes D − r weight versions and holds D − r
    micro-batches (1F1B in flight). PipeDream-2BW: two weight versions, D − r micro-batches.
    PipeDream and PipeDream-2BW: the last rank keeps its full activations even when the run
    recomputes (:data:`~.schemes.LAST_STAGE_NOT_RECOMPUTED`)."""
    stored = activation_bytes(model, micro_batch_size, num_stages, recompute)
    memory = []
    for rank in range(num_stages):
        mode = recompute
        if scheme in LAST_STAGE_NOT_RECOMPUTED and rank == num_stages - 1 and num_stages > 1:
            mode = "none"  # the authors' runtime never recomputes the last stage
            stored_here = activation_bytes(model, micro_batch_size, num_stages, mode, [rank])
        else:
            stored_here = stored
        if scheme == "gems":
            stages, versions, in_flight = sorted({rank, num_stages - 1 - rank}), 1, 1
        elif scheme == "pipedream":
            stages, versions, in_flight = [rank], num_stages - rank, num_stages - rank
        elif scheme == "pipedream-2bw":
            stages, versions, in_flight = [rank], 2, num_stages - rank
        else:
            raise ValueError(f"{scheme!r} is not an analytic baseline")
        memory.append(state_bytes(model, hardware, num_stages, stages, replicas,
                                  weight_versions=versions)
                      + in_flight * stored_here + hardware.framework_overhead_bytes
                      + working_bytes(model, num_stages, micro_batch_size, mode,
                                      num_stages - 1 in stages))
    return memory


BASELINE_TIMES = {"gems": gems_time, "pipedream": pipedream_time,
                  "pipedream-2bw": pipedream_2bw_time}
