"""Terms of the model: parameters, FLOPs, compute time, activations, p2p and all-reduce times.

Each function is one term; docs/performance_model.md justifies each and
tests/unit/test_performance_model.py checks each against a hand-computed case or the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.performance_model.specs import HardwareSpec, ModelSpec, recompute_mode


@dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch times (s) and sizes (bytes) the schedule models need."""

    forward: float  # F of one stage
    backward: float  # Bk of one stage (includes any recomputation)
    p2p: float  # Cp2p
    allreduce: tuple  # all-reduce time of each stage
    gradient_bytes: tuple  # gradient bytes of each stage
    overlap_slowdown: float = 0.0  # σ: compute runs 1 + σ slower while a sync is in flight
    stage_forward: tuple = ()  # F of each stage (empty: every stage costs ``forward``)
    stage_backward: tuple = ()  # Bk of each stage (empty: every stage costs ``backward``)
    allreduce_alone: tuple = ()  # each stage's all-reduce when no other stage syncs meanwhile
    optimizer_step: tuple = ()  # each stage's optimizer step (empty: free)

    def optimizer_step_of(self, stage: int) -> float:
        return self.optimizer_step[stage] if self.optimizer_step else 0.0

    def forward_of(self, stage: int) -> float:
        return self.stage_forward[stage] if self.stage_forward else self.forward

    def backward_of(self, stage: int) -> float:
        return self.stage_backward[stage] if self.stage_backward else self.backward


def check_split(model: ModelSpec, num_stages: int) -> None:
    counts = model.stage_layer_counts
    if counts:
        if len(counts) != num_stages or sum(counts) != model.num_layers or min(counts) < 0:
            raise ValueError(f"stage_layer_counts {tuple(counts)} must give the layers of each of "
                             f"the {num_stages} model stages, {model.num_layers} in all")
        return
    if num_stages < 1 or model.num_layers % num_stages:
        raise ValueError(f"--num-layers {model.num_layers} cannot be split evenly over "
                         f"{num_stages} pipeline stages; choose a pipeline size that divides it")


def stage_layers(model: ModelSpec, num_stages: int, stage: int) -> int:
    """Transformer layers of model stage ``stage`` (even split, or ``stage_layer_counts``)."""
    check_split(model, num_stages)
    if model.stage_layer_counts:
        return model.stage_layer_counts[stage]
    return model.num_layers // num_stages


def layer_parameters(model: ModelSpec) -> int:
    """Parameters of one transformer layer: QKV, projection, two FFN matrices (with biases),
    two layer norms."""
    h, ffn = model.hidden_size, model.ffn
    return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h


def stage_parameters(model: ModelSpec, num_stages: int, stage: int) -> int:
    """Parameters of one pipeline stage (its layers; embedding + positions on stage 0, final
    norm + untied output layer on the last stage)."""
    params = stage_layers(model, num_stages, stage) * layer_parameters(model)
    if stage == 0:
        params += (model.vocab_size + model.positions) * model.hidden_size
    if stage == num_stages - 1:
        params += 2 * model.hidden_size + model.vocab_size * model.hidden_size
    return params


def total_parameters(model: ModelSpec) -> int:
    """Parameters of the whole model (sum over the stages of a one-stage pipeline)."""
    return stage_parameters(model, 1, 0)


def layer_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    """Forward FLOPs of one layer on one micro-batch (Megatron's count of matrix multiplies:
    8·B·s·h² + 4·B·s²·h + 4·B·s·h·ffn; with ffn = 4h this is 24·B·s·h²·(1 + s/(6h)))."""
    b, s, h = micro_batch_size, model.seq_length, model.hidden_size
    return 8 * b * s * h * h + 4 * b * s * s * h + 4 * b * s * h * model.ffn


def attention_core_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    """Forward FLOPs of one layer's attention core (scores Q·Kᵀ and context A·V): 4·B·s²·h,
    the part selective recomputation re-runs."""
    return 4 * micro_batch_size * model.seq_length ** 2 * model.hidden_size


def output_layer_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    """Forward FLOPs of the logits matrix multiply: 2·B·s·h·V."""
    return 2 * micro_batch_size * model.seq_length * model.hidden_size * model.vocab_size


def stage_forward_flops(model: ModelSpec, num_stages: int, stage: int,
                        micro_batch_size: int) -> float:
    """Forward FLOPs of a stage on one micro-batch (embedding lookups are free)."""
    flops = stage_layers(model, num_stages, stage) * layer_forward_flops(model, micro_batch_size)
    if stage == num_stages - 1:
        flops += output_layer_forward_flops(model, micro_batch_size)
    return flops


def recompute_flops(model: ModelSpec, num_stages: int, micro_batch_size: int,
                    recompute, stage: int = 0, whole_stage: bool = False) -> float:
    """Extra forward FLOPs one stage's backward re-runs: the stage's layers (full; the output
    layer is not recomputed unless ``whole_stage``: the runtime re-runs the stage's whole
    forward, ``HardwareSpec.recompute_whole_stage``), their attention cores (selective),
    nothing (none)."""
    mode = recompute_mode(recompute)
    layers = stage_layers(model, num_stages, stage)
    if mode == "full":
        flops = layers * layer_forward_flops(model, micro_batch_size)
        if whole_stage and stage == num_stages - 1:
            flops += output_layer_forward_flops(model, micro_batch_size)
        return flops
    if mode == "selective":
        return layers * attention_core_forward_flops(model, micro_batch_size)
    return 0.0


def compute_times(model: ModelSpec, hardware: HardwareSpec, num_stages: int,
                  micro_batch_size: int, recompute, stage_balance: str = "balanced"):
    """(F, Bk) of a stage on one micro-batch, at the rate the micro-batch size reaches.

    Bk = 2·F (backward: two matrix multiplies per forward one) + the recomputed forward FLOPs;
    each also pays ``hardware.op_overhead_seconds`` (a fixed cost per op).
    ``stage_balance``: ``balanced`` (the paper: whole-model FLOPs / D) or ``slowest`` (the
    last stage of an even layer split, which also runs the output layer; ``per-stage``
    returns the same here, its per-stage times come from :func:`stage_compute_times`).
    """
    check_split(model, num_stages)
    flops = [stage_forward_flops(model, num_stages, s, micro_batch_size)
             for s in range(num_stages)]
    if stage_balance == "balanced":
        stage_flops = sum(flops) / num_stages
    elif stage_balance in ("slowest", "per-stage"):
        stage_flops = max(flops)
    else:
        raise ValueError(f"unknown stage balance {stage_balance!r}; use 'balanced', 'slowest' "
                         "or 'per-stage'")
    rate = hardware.sustained_rate(micro_batch_size * model.seq_length)
    extras = [recompute_flops(model, num_stages, micro_batch_size, recompute, s,
                              hardware.recompute_whole_stage)
              for s in range(num_stages)]
    # balanced: the mean stage; slowest: the stage with the most forward FLOPs
    extra = (sum(extras) / num_stages if stage_balance == "balanced"
             else extras[flops.index(max(flops))])
    overhead = hardware.op_overhead_seconds
    return stage_flops / rate + overhead, (2 * stage_flops + extra) / rate + overhead


def stage_compute_times(model: ModelSpec, hardware: HardwareSpec, num_stages: int,
                        micro_batch_size: int, recompute):
    """(F of each stage, Bk of each stage) of the layer split: the last stage also runs
    the output layer (2·B·s·h·V FLOPs forward, which at the paper's GPT-2 is three layers'
    worth), which recomputation re-runs only with ``hardware.recompute_whole_stage``. Same rate and op overhead as
    :func:`compute_times`."""
    check_split(model, num_stages)
    rate = hardware.sustained_rate(micro_batch_size * model.seq_length)
    overhead = hardware.op_overhead_seconds
    flops = [stage_forward_flops(model, num_stages, s, micro_batch_size)
             for s in range(num_stages)]
    extras = [recompute_flops(model, num_stages, micro_batch_size, recompute, s,
                              hardware.recompute_whole_stage)
              for s in range(num_stages)]
    return (tuple(f / rate + overhead for f in flops),
            tuple((2 * f + extra) / rate + overhead for f, extra in zip(flops, extras)))


def activation_bytes_per_layer(model: ModelSpec, micro_batch_size: int, recompute) -> float:
    """Activations one layer keeps for its backward, per micro-batch.

    None: Korthikanti et al.'s s·B·h·(34 + 5·a·s/h) bytes for 16-bit values, scaled to
    ``bytes_per_value`` (dropout masks counted as values: a slight over-estimate for fp32).
    Selective: the 5·a·s/h attention-core term is recomputed, 34·s·B·h remain. Full: only the
    layer input, s·B·h values.
    """
    mode = recompute_mode(recompute)
    b, s, h = micro_batch_size, model.seq_length, model.hidden_size
    if mode == "full":
        return s * b * h * model.bytes_per_value
    per_layer = 34.0 if mode == "selective" else 34 + 5 * model.num_attention_heads * s / h
    return s * b * h * per_layer * model.bytes_per_value / 2


def activation_bytes(model: ModelSpec, micro_batch_size: int, num_stages: int,
                     recompute, stages=None) -> float:
    """Activations one stored micro-batch of one stage occupies (its layers): of the largest of
    ``stages`` (default all; every stage alike when the split is even)."""
    stages = range(num_stages) if stages is None else stages
    return max(stage_layers(model, num_stages, stage) for stage in stages) * \
        activation_bytes_per_layer(model, micro_batch_size, recompute)


#: Bytes the authors' AdamW step (transformers' ``AdamW.step``, fp32, unfused) moves per
#: parameter: exp_avg.mul_ (8), .add_(grad) (12), exp_avg_sq.mul_ (8), .addcmul_(grad, grad)
#: (12), sqrt() (8), .add_(eps) (8), p.addcdiv_ (16); weight decay (set per run) not counted.
OPTIMIZER_STEP_BYTES_PER_PARAMETER = 72


def optimizer_step_time(hardware: HardwareSpec, parameters: float) -> float:
    """One optimizer step over ``parameters``: element-wise passes bound by the device memory
    bandwidth (:data:`OPTIMIZER_STEP_BYTES_PER_PARAMETER` bytes each); 0 where the profile
    gives no memory bandwidth."""
    if hardware.memory_bandwidth <= 0:
        return 0.0
    return parameters * OPTIMIZER_STEP_BYTES_PER_PARAMETER / hardware.memory_bandwidth


def host_staging_time(hardware: HardwareSpec, message_bytes: float) -> float:
    """Copying L bytes from the device to the host and the result back (gloo works on host
    memory): 2·L / the host link bandwidth; 0 without staging."""
    if hardware.host_staging_bandwidth <= 0:
        return 0.0
    return 2 * message_bytes / hardware.host_staging_bandwidth


def p2p_time(hardware: HardwareSpec, message_bytes: float) -> float:
    """Cp2p = α + β·L for one message of L bytes, plus its host staging (sender's copy out,
    receiver's copy in: :func:`host_staging_time`)."""
    return hardware.alpha + hardware.beta * message_bytes + host_staging_time(hardware,
                                                                              message_bytes)


def cross_group_fraction(hardware: HardwareSpec, num_nodes: int) -> float:
    """Share of a node's collective traffic that leaves its dragonfly group: 1 − G/P for a job
    of P nodes filling P/G groups of G nodes, with a collective's peers spread evenly over the
    job (stage replicas are D ranks apart, so they span the whole job); 0 when the job fits in
    one group or the network is flat (``nodes_per_group`` 0)."""
    group = hardware.nodes_per_group
    if group <= 0 or num_nodes <= group:
        return 0.0
    return 1.0 - group / num_nodes


def network_contention(hardware: HardwareSpec, num_nodes: int,
                       syncing_nodes: int | None = None) -> float:
    """Slowdown of the bandwidth term of gradient all-reduces when all P nodes of the job sync
    at once: max(1, c(P)/γ), c = :func:`cross_group_fraction`, γ =
    ``global_bandwidth_fraction``. A node's bytes flow through its injection link and, for the
    share c that leaves the group, through the tapered global links where it gets γ of its
    injection bandwidth; the slower of the two pipelined resources sets the rate.
    ``syncing_nodes`` (default all P): when only that many nodes of the job sync at once (one
    stage's replicas, PipeDream-2BW's stage-by-stage syncs), the global links carry that
    share of the load: max(1, c(P)·(syncing/P)/γ)."""
    load = 1.0 if syncing_nodes is None else min(1.0, syncing_nodes / num_nodes)
    return max(1.0, cross_group_fraction(hardware, num_nodes) * load
               / hardware.global_bandwidth_fraction)


#: DistributedDataParallel's default gradient bucket (``bucket_cap_mb=25``, PyTorch docs): the
#: authors' PipeDream and PipeDream-2BW runtimes sync through DDP, one all-reduce per bucket.
DDP_BUCKET_BYTES = 25 * 2 ** 20


def ddp_buckets(message_bytes: float) -> int:
    """All-reduces DDP issues for ``message_bytes`` of gradients (25 MiB buckets)."""
    return max(1, math.ceil(message_bytes / DDP_BUCKET_BYTES))


def allreduce_time(hardware: HardwareSpec, num_replicas: int, message_bytes: float,
                   contention: float = 1.0, messages: int = 1) -> float:
    """Rabenseifner all-reduce of L bytes over r ranks: 2·log2(r)·α + 2(r−1)/r·β·L·κ; 0 for r = 1.
    With ``hardware.allreduce_algorithm == "ring"`` (gloo's ring) the latency term is
    2(r−1)·α: each of the 2(r−1) ring steps waits for one message.

    With host staging (gloo on CUDA tensors) the gradient is copied to the host and back
    (:func:`host_staging_time`; not slowed by the network).
    ``messages``: the bytes go as that many separate all-reduces (DDP's buckets,
    :func:`ddp_buckets`), each paying the latency term; the bandwidth term is the same.
    κ = ``contention`` (:func:`network_contention`, 1 = the link alone). (log2 of a non-power
    of two is used as is: the formula is the model, not an algorithm.) This is the time alone
    on the rank's link; :func:`shared_link_finish_times` shares the link.
    """
    if num_replicas < 1:
        raise ValueError(f"an all-reduce needs at least one rank (got {num_replicas})")
    if contention < 1:
        raise ValueError(f"network contention is a slowdown >= 1 (got {contention})")
    if num_replicas == 1:
        return 0.0
    r = num_replicas
    steps = 2 * (r - 1) if hardware.allreduce_algorithm == "ring" else 2 * math.log2(r)
    return (messages * steps * hardware.alpha
            + 2 * (r - 1) / r * hardware.beta * message_bytes * contention
            + host_staging_time(hardware, message_bytes))


def shared_link_finish_times(jobs) -> list:
    """Finish times of collectives sharing one rank's link fairly (processor sharing).

    ``jobs``: (start, time alone on the link) pairs. While k collectives are in flight each
    progresses at 1/k of its solo rate, so two syncs started together both end after the sum
    of their times (end sync), and one started early runs alone until the other starts (eager).
    """
    remaining = {i: float(work) for i, (_, work) in enumerate(jobs) if work > 0}
    finish = [float(start) for start, _ in jobs]
    starts = sorted((float(start), i) for i, (start, _) in enumerate(jobs) if i in remaining)
    active, now, position = set(), 0.0, 0
    while position < len(starts) or active:
        if not active:
            now = max(now, starts[position][0])
        while position < len(starts) and starts[position][0] <= now:
            active.add(starts[position][1])
            position += 1
        shortest = min(remaining[i] for i in active)
        until_next = starts[position][0] - now if position < len(starts) else math.inf
        step = min(shortest * len(active), until_next)
        share = step / len(active)
        for i in list(active):
            remaining[i] -= share
            if remaining[i] <= 1e-15:
                active.discard(i)
                finish[i] = now + step
        now += step
    return finish


def overlap_delay(compute_intervals, sync_windows, slowdown: float) -> float:
    """Delay one rank adds to the iteration when its compute is slowed by in-flight syncs.

    ``compute_intervals``: (start, end) of the rank's compute ops; ``sync_windows``: (start,
    end) while one of its gradient syncs progresses. Compute inside a window runs 1 + σ slower,
    i.e. costs σ × overlap extra; idle gaps between the rank's compute ops after the first
    window's start absorb it (a stretched op pushes into the gap before the next op, which
    was waiting for an input anyway); the rest delays the iteration: the rank's last op feeds
    a neighbour's last backward or its own sync, so no later slack is counted. Eager sync on a rank with no
    idle time after the launch (the middle workers of Chimera) pays it in full; that is the
    paper's reason for eager-sync-opt (chimera.md §5).
    """
    windows = sorted((start, end) for start, end in sync_windows if end > start)
    if slowdown <= 0 or not windows:
        return 0.0
    merged = [list(windows[0])]
    for start, end in windows[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    overlap = sum(max(0.0, min(end, w_end) - max(start, w_start))
                  for start, end in compute_intervals for w_start, w_end in merged)
    first = merged[0][0]
    last = max((end for _, end in compute_intervals), default=first)
    busy_after = sum(max(0.0, end - max(start, first)) for start, end in compute_intervals)
    slack = max(0.0, last - first - busy_after)
    return max(0.0, slowdown * overlap - slack)
