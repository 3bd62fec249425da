"""Performance model of pipeline schedules (Chimera paper §3.4) and configuration search.

This module owns the *predicted* iteration time, memory per worker and throughput of a
(scheme, W, D, B, N, recompute) configuration, and the search over such configurations. It
imports no torch; it reuses the pure-Python schedule stack (build, lower, simulate).

Two estimates of the iteration time are given for every configuration:

* :func:`closed_form_iteration_time` -- the paper's formula
  ``T = (F + Cp2p)·Cf + (Bk + Cp2p)·Cb + max_r exposed_allreduce(r)`` with critical-path counts
  Cf, Cb (:func:`critical_path_counts`).
* :func:`simulated_iteration_time` -- the lowered schedule run by
  :func:`~megatron.core.pipeline_parallel.planning.simulator.simulate` with ``p2p_cost = Cp2p`` and the
  per-stage all-reduce times applied to the simulated gradient-sync start times, so the overlap
  of eager gradient sync with each worker's idle regions is that of the real lowered schedule.

Assumptions shared by both (they are the model, not facts about a machine):

* Units: seconds and bytes. ``HardwareSpec.flops_per_second`` is the *sustained* rate of one
  worker (peak × efficiency), the same for every kernel and micro-batch size.
* Uniform per-stage costs (the simulator takes one F and one Bk). ``stage_balance="balanced"``
  (default, the paper's model) uses F = whole-model forward FLOPs / D; ``"slowest"`` uses the
  slowest stage of the runtime's even layer split (the last one: it also runs the output layer),
  an upper bound that is pessimistic for deep pipelines (GPT-2, D = 64: the output layer is 3×
  one layer). Memory always uses the real split (embedding on stage 0, output layer on D−1).
* Bk = 2F without recomputation, 3F with full recomputation (forward re-run before backward).
* One tensor-parallel slice: P workers = W·D, no tensor parallelism inside the model.
* Point-to-point: one message of one micro-batch activation (or gradient) per op,
  ``Cp2p = α + β·B·s·h·bytes``; every compute op on the critical path pays one Cp2p (paper).
* All-reduce: Rabenseifner, ``2·log2(r)·α + 2(r−1)/r·β·L``; r = 2W replicas per Chimera stage
  (two pipelines, W pairs), r = W for 1F1B and GPipe; zero when r = 1. Syncs of different stages
  run concurrently without sharing bandwidth (the simulator's semantics too).
* Only the 2-pipeline Chimera (f = 1) is modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from megatron.core.pipeline_parallel.planning.lowering import GradSyncStart, GradSyncWait
from megatron.core.pipeline_parallel.planning.simulator import peak_activations, simulate

# Scheme name -> (schedule name, schedule options).
SCHEMES = {
    "chimera-direct": ("chimera", {"variant": "direct"}),
    "chimera-forward-doubling": ("chimera", {"variant": "forward-doubling"}),
    "1f1b": ("1f1b", {}),
    "gpipe": ("gpipe", {}),
}


@dataclass(frozen=True)
class ModelSpec:
    """A GPT model: Megatron flag names. ``ffn_hidden_size`` defaults to 4·hidden.

    ``bytes_per_value`` is the width of weights, activations and gradients (4 = fp32, as in the
    paper). The output layer is untied from the embedding (the paper's GPT-2).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    max_position_embeddings: int | None = None
    bytes_per_value: int = 4

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class HardwareSpec:
    """One worker and its network.

    ``flops_per_second``: sustained FLOP/s of one worker. ``alpha``: per-message latency (s).
    ``beta``: seconds per byte (1 / bandwidth). ``device_memory_bytes``: usable memory.
    ``state_bytes_per_parameter``: weights + gradients + optimizer state per parameter
    (16 = fp32 weight, fp32 gradient, two fp32 Adam moments).
    """

    flops_per_second: float
    alpha: float
    beta: float
    device_memory_bytes: float
    state_bytes_per_parameter: int = 16


@dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch times (s) and sizes (bytes) the schedule models need."""

    forward: float  # F of the slowest stage
    backward: float  # Bk of the slowest stage
    p2p: float  # Cp2p
    allreduce: tuple  # all-reduce time of each stage
    gradient_bytes: tuple  # gradient bytes of each stage


@dataclass
class Estimate:
    """Prediction for one configuration; times in seconds, memory in bytes."""

    scheme: str
    data_parallel: int  # W
    pipeline: int  # D
    micro_batch_size: int  # B
    num_microbatches: int  # N
    recompute: bool
    global_batch_size: int
    closed_form_time: float | None
    simulated_time: float
    memory_per_worker: list = field(default_factory=list)
    device_memory_bytes: float = 0.0
    costs: StageCosts | None = None

    @property
    def iteration_time(self) -> float:
        """The ranking time: the simulator's (exact for the lowered schedule)."""
        return self.simulated_time

    @property
    def throughput(self) -> float:
        """Sequences per second."""
        return self.global_batch_size / self.iteration_time

    @property
    def max_memory(self) -> float:
        return max(self.memory_per_worker)

    @property
    def fits(self) -> bool:
        return self.max_memory <= self.device_memory_bytes


# ----------------------------------------------------------------------------- model size


def layer_parameters(model: ModelSpec) -> int:
    """Parameters of one transformer layer: QKV, projection, two FFN matrices (with biases),
    two layer norms."""
    h, ffn = model.hidden_size, model.ffn
    return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h


def stage_parameters(model: ModelSpec, num_stages: int, stage: int) -> int:
    """Parameters of one pipeline stage (even layer split; embedding + positions on stage 0,
    final norm + untied output layer on the last stage)."""
    _check_split(model, num_stages)
    params = model.num_layers // num_stages * layer_parameters(model)
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


def output_layer_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    """Forward FLOPs of the logits matrix multiply: 2·B·s·h·V."""
    return 2 * micro_batch_size * model.seq_length * model.hidden_size * model.vocab_size


def stage_forward_flops(model: ModelSpec, num_stages: int, stage: int,
                        micro_batch_size: int) -> float:
    """Forward FLOPs of a stage on one micro-batch (embedding lookups are free)."""
    _check_split(model, num_stages)
    flops = model.num_layers // num_stages * layer_forward_flops(model, micro_batch_size)
    if stage == num_stages - 1:
        flops += output_layer_forward_flops(model, micro_batch_size)
    return flops


def activation_bytes_per_layer(model: ModelSpec, micro_batch_size: int,
                               recompute: bool) -> float:
    """Activations one layer keeps for its backward, per micro-batch.

    Without recomputation: Korthikanti et al.'s count s·B·h·(34 + 5·a·s/h) bytes for 16-bit
    values, scaled to ``bytes_per_value`` (dropout masks are counted as values: a slight
    over-estimate for fp32). With full recomputation: only the layer input, s·B·h values.
    """
    b, s, h = micro_batch_size, model.seq_length, model.hidden_size
    if recompute:
        return s * b * h * model.bytes_per_value
    per_value_16bit = s * b * h * (34 + 5 * model.num_attention_heads * s / h)
    return per_value_16bit * model.bytes_per_value / 2


def activation_bytes(model: ModelSpec, micro_batch_size: int, num_stages: int,
                     recompute: bool) -> float:
    """Activations one stored micro-batch of one stage occupies (its layers)."""
    return model.num_layers // num_stages * activation_bytes_per_layer(
        model, micro_batch_size, recompute)


def _check_split(model: ModelSpec, num_stages: int) -> None:
    if num_stages < 1 or model.num_layers % num_stages:
        raise ValueError(f"--num-layers {model.num_layers} cannot be split evenly over "
                         f"{num_stages} pipeline stages; choose a pipeline size that divides it")


# ----------------------------------------------------------------------------- communication


def p2p_time(hardware: HardwareSpec, message_bytes: float) -> float:
    """Cp2p = α + β·L for one message of L bytes."""
    return hardware.alpha + hardware.beta * message_bytes


def allreduce_time(hardware: HardwareSpec, num_replicas: int, message_bytes: float) -> float:
    """Rabenseifner all-reduce of L bytes over r ranks: 2·log2(r)·α + 2(r−1)/r·β·L; 0 for r = 1.

    (log2 of a non-power of two is used as is: the formula is the model, not an algorithm.)
    """
    if num_replicas < 1:
        raise ValueError(f"an all-reduce needs at least one rank (got {num_replicas})")
    if num_replicas == 1:
        return 0.0
    r = num_replicas
    return 2 * math.log2(r) * hardware.alpha + 2 * (r - 1) / r * hardware.beta * message_bytes


def num_replicas(scheme: str, data_parallel: int) -> int:
    """Ranks holding one stage: 2W for Chimera (both directions), W otherwise."""
    return 2 * data_parallel if _schedule(scheme)[0] == "chimera" else data_parallel


def stage_costs(model: ModelSpec, hardware: HardwareSpec, scheme: str, data_parallel: int,
                num_stages: int, micro_batch_size: int, recompute: bool,
                stage_balance: str = "balanced") -> StageCosts:
    """F, Bk, Cp2p and each stage's all-reduce time for one configuration.

    ``stage_balance``: ``balanced`` (the paper's model: F = whole-model forward FLOPs / D, as if
    the output layer's work were spread over the stages) or ``slowest`` (this project's even
    layer split: F = the last stage's forward, which also runs the output layer).
    """
    stage_flops = [stage_forward_flops(model, num_stages, stage, micro_batch_size)
                   for stage in range(num_stages)]
    if stage_balance == "balanced":
        forward = sum(stage_flops) / num_stages / hardware.flops_per_second
    elif stage_balance == "slowest":
        forward = max(stage_flops) / hardware.flops_per_second
    else:
        raise ValueError(f"unknown stage balance {stage_balance!r}; use 'balanced' or 'slowest'")
    backward = (3 if recompute else 2) * forward
    message = micro_batch_size * model.seq_length * model.hidden_size * model.bytes_per_value
    replicas = num_replicas(scheme, data_parallel)
    gradient_bytes = tuple(stage_parameters(model, num_stages, stage) * model.bytes_per_value
                           for stage in range(num_stages))
    allreduce = tuple(allreduce_time(hardware, replicas, size) for size in gradient_bytes)
    return StageCosts(forward, backward, p2p_time(hardware, message) if num_stages > 1 else 0.0,
                      allreduce, gradient_bytes)


# ----------------------------------------------------------------------------- closed form


def critical_path_counts(scheme: str, num_stages: int, num_microbatches: int):
    """(Cf, Cb): forwards and backwards on the critical path, or None where no closed form is
    known here.

    Chimera direct, N = K·D (K = 1 is the basic unit): Cf = 2K + D − 2, Cb = K(2D − 2); this is the
    exact zero-communication makespan for Bk >= F (chimera.md §4); forward doubling with N = D
    is the same basic unit. 1F1B and GPipe: Cf = Cb = N + D − 1. Chimera with N not a multiple
    of D and forward doubling with N >= 2D: None (use the simulator).
    """
    name, options = _schedule(scheme)
    d, n = num_stages, num_microbatches
    if name == "chimera":
        # Forward doubling with N = D is one ordinary basic unit (chimera.md §3).
        basic = options["variant"] == "direct" or (options["variant"] == "forward-doubling"
                                                   and n == d)
        if not basic or n % d:
            return None
        k = n // d
        return 2 * k + d - 2, k * (2 * d - 2)
    return n + d - 1, n + d - 1


def exposed_allreduce(scheme: str, num_stages: int, costs: StageCosts,
                      grad_sync_policy: str = "eager-opt") -> list:
    """Closed-form all-reduce time each worker cannot hide (list over pipeline ranks).

    Chimera: worker r hosts its early stage e = min(r, D−1−r) and its late stage D−1−e. The
    early stage finishes with the worker's last backward, so its sync is fully exposed. The late
    stage (eager sync) finishes while a = D/2 − e backwards of the early stage remain, so
    a·Bk of its sync is hidden (idle gaps between those backwards are ignored: the closed form
    hides at most as much as the simulator). eager-opt does not start it early on the two middle
    workers (a = 1), ``end`` on none. 1F1B / GPipe: every worker syncs its stage at the end.
    """
    d = num_stages
    if _schedule(scheme)[0] != "chimera":
        return list(costs.allreduce)
    exposed = []
    for rank in range(d):
        early = min(rank, d - 1 - rank)
        late = d - 1 - early
        remaining = d // 2 - early
        eager = grad_sync_policy == "eager" or (grad_sync_policy == "eager-opt" and remaining > 1)
        hidden = remaining * costs.backward if eager else 0.0
        exposed.append(max(costs.allreduce[early], costs.allreduce[late] - hidden))
    return exposed


def closed_form_iteration_time(scheme: str, num_stages: int, num_microbatches: int,
                               costs: StageCosts, grad_sync_policy: str = "eager-opt"):
    """T = (F + Cp2p)·Cf + (Bk + Cp2p)·Cb + max_r exposed all-reduce, or None (no counts)."""
    counts = critical_path_counts(scheme, num_stages, num_microbatches)
    if counts is None:
        return None
    forward_count, backward_count = counts
    return ((costs.forward + costs.p2p) * forward_count
            + (costs.backward + costs.p2p) * backward_count
            + max(exposed_allreduce(scheme, num_stages, costs, grad_sync_policy)))


# ----------------------------------------------------------------------------- simulator


def _schedule(scheme: str):
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    return SCHEMES[scheme]


def lowered_schedule(scheme: str, num_stages: int, num_microbatches: int,
                     grad_sync_policy: str = "eager-opt"):
    """Build, validate and lower a scheme once (planning costs F = 1, Bk = 2; the lowering
    stays valid and reaches the closed-form makespans for other costs, docs/schedules.md).
    Cached: a search asks for the same schedule many times."""
    return _lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy)


@lru_cache(maxsize=256)
def _lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy):
    from megatron.core.pipeline_parallel.planning.lowering import lower_schedule
    from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout
    from megatron.core.pipeline_parallel.planning.validator import validate_schedule

    name, options = _schedule(scheme)
    schedule = build_schedule(name, num_stages, num_microbatches, **options)
    layout = schedule_layout(name, num_stages, **options)
    validate_schedule(schedule, layout, num_microbatches)
    lowered = lower_schedule(schedule, layout, grad_sync_policy)
    return tuple(tuple(ops) for ops in lowered)


@lru_cache(maxsize=256)
def peak_stored_microbatches(scheme: str, num_stages: int, num_microbatches: int) -> tuple:
    """Most micro-batch activations stored at once on each pipeline rank (all hosted stages)."""
    return tuple(peak_activations(ops)
                 for ops in lowered_schedule(scheme, num_stages, num_microbatches))


def simulated_iteration_time(scheme: str, num_stages: int, num_microbatches: int,
                             costs: StageCosts, grad_sync_policy: str = "eager-opt") -> float:
    """Makespan of the lowered schedule with F, Bk, Cp2p and per-stage all-reduce times.

    The simulator runs with all-reduce cost 0; each stage's sync then completes its all-reduce
    time after the last replica started it (the simulator's own rule, applied per stage because
    stages differ in size) and a worker ends when its compute and its syncs have.
    """
    lowered = lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy)
    result = simulate([list(ops) for ops in lowered], costs.forward, costs.backward, costs.p2p, 0)
    starts = {}
    for timeline in result.timelines:
        for entry in timeline:
            if isinstance(entry.op, GradSyncStart):
                starts[entry.op.stage] = max(starts.get(entry.op.stage, 0.0), entry.start)
    makespan = 0.0
    for timeline in result.timelines:
        end = 0.0
        for entry in timeline:
            if isinstance(entry.op, GradSyncStart):
                end = max(end, starts[entry.op.stage] + costs.allreduce[entry.op.stage])
            elif not isinstance(entry.op, GradSyncWait):
                end = max(end, entry.end)
        makespan = max(makespan, end)
    return makespan


# ----------------------------------------------------------------------------- memory


def memory_per_worker(model: ModelSpec, hardware: HardwareSpec, scheme: str, num_stages: int,
                      num_microbatches: int, micro_batch_size: int, recompute: bool) -> list:
    """Bytes each pipeline rank needs: model state of its hosted stages (2 stages for Chimera,
    the paper's 2·Mθ) + peak stored micro-batches (from the lowered schedule) × one stage's
    activations + working set: with recomputation one layer's full activations (the layer being
    recomputed); on the rank holding the last stage the logits and their gradient
    (2·B·s·V values). Framework overhead and fragmentation are not modelled.
    """
    from megatron.core.pipeline_parallel.planning.schedules import schedule_layout

    name, options = _schedule(scheme)
    layout = schedule_layout(name, num_stages, **options)
    peaks = peak_stored_microbatches(scheme, num_stages, num_microbatches)
    stored = activation_bytes(model, micro_batch_size, num_stages, recompute)
    working = activation_bytes_per_layer(model, micro_batch_size, False) if recompute else 0.0
    logits = 2 * micro_batch_size * model.seq_length * model.vocab_size * model.bytes_per_value
    memory = []
    for rank in range(num_stages):
        stages = [stage for _, stage in layout.hosted(rank)]
        state = sum(stage_parameters(model, num_stages, stage) for stage in stages)
        total = state * hardware.state_bytes_per_parameter + peaks[rank] * stored + working
        if num_stages - 1 in stages:
            total += logits
        memory.append(total)
    return memory


# ----------------------------------------------------------------------------- configurations


def evaluate(model: ModelSpec, hardware: HardwareSpec, scheme: str, data_parallel: int,
             num_stages: int, micro_batch_size: int, num_microbatches: int, recompute: bool,
             grad_sync_policy: str = "eager-opt", stage_balance: str = "balanced") -> Estimate:
    """Predict one configuration (both time estimates and the memory per worker)."""
    _check_schedule(scheme, num_stages, num_microbatches)
    costs = stage_costs(model, hardware, scheme, data_parallel, num_stages, micro_batch_size,
                        recompute, stage_balance)
    return Estimate(
        scheme=scheme, data_parallel=data_parallel, pipeline=num_stages,
        micro_batch_size=micro_batch_size, num_microbatches=num_microbatches, recompute=recompute,
        global_batch_size=data_parallel * micro_batch_size * num_microbatches,
        closed_form_time=closed_form_iteration_time(scheme, num_stages, num_microbatches, costs,
                                                    grad_sync_policy),
        simulated_time=simulated_iteration_time(scheme, num_stages, num_microbatches, costs,
                                                grad_sync_policy),
        memory_per_worker=memory_per_worker(model, hardware, scheme, num_stages,
                                            num_microbatches, micro_batch_size, recompute),
        device_memory_bytes=hardware.device_memory_bytes, costs=costs)


def _check_schedule(scheme: str, num_stages: int, num_microbatches: int) -> None:
    from megatron.core.pipeline_parallel.planning.schedules import check_schedule_options
    name, options = _schedule(scheme)
    check_schedule_options(name, num_stages, num_microbatches, **options)


def valid_shapes(scheme: str, world_size: int, num_layers: int, global_batch_size: int) -> list:
    """(W, D) pairs with W·D = P, D dividing the layers, W dividing the mini-batch, D even for
    Chimera (D >= 2)."""
    shapes = []
    for depth in range(1, world_size + 1):
        if world_size % depth or num_layers % depth:
            continue
        if _schedule(scheme)[0] == "chimera" and depth % 2:
            continue
        width = world_size // depth
        if global_batch_size % width:
            continue
        shapes.append((width, depth))
    return shapes


def _schedule_allows(scheme: str, num_stages: int, num_microbatches: int) -> bool:
    try:
        _check_schedule(scheme, num_stages, num_microbatches)
    except ValueError:
        return False
    return True


def search_configurations(model: ModelSpec, hardware: HardwareSpec, world_size: int,
                          global_batch_size: int, schemes=("chimera-direct",),
                          micro_batch_size: int | None = None, recompute: bool | None = None,
                          grad_sync_policy: str = "eager-opt", stage_balance: str = "balanced",
                          micro_batch_policy: str = "fastest", shapes=None) -> list[Estimate]:
    """Rank configurations by predicted throughput (sequences/s, highest first).

    For each scheme and valid (W, D) (or the given ``shapes``): N·B = mini-batch / W, B a divisor
    of it allowed by the schedule (or ``micro_batch_size``). Recomputation off and on are both
    tried (``recompute`` None) or only the given setting. For each (scheme, W, D, recompute) one
    micro-batch size is kept: ``micro_batch_policy="largest"`` the largest B that fits (the
    paper's rule, which assumes kernels get faster with B; this model's FLOP/s does not depend
    on B, so it favours few large micro-batches and big bubbles), ``"fastest"`` the fitting B
    with the highest predicted throughput. A shape where nothing fits appears once (smallest B,
    with recomputation if allowed) with fits False, so the table says why. Fitting
    configurations rank before non-fitting ones.
    """
    if world_size < 1 or global_batch_size < 1:
        raise ValueError("--world-size and --global-batch-size must be positive")
    if micro_batch_policy not in ("largest", "fastest"):
        raise ValueError(f"unknown micro-batch policy {micro_batch_policy!r}; "
                         "use 'largest' or 'fastest'")
    estimates = []
    for scheme in schemes:
        candidate_shapes = shapes or valid_shapes(scheme, world_size, model.num_layers,
                                                  global_batch_size)
        for width, depth in candidate_shapes:
            if width * depth != world_size or global_batch_size % width:
                raise ValueError(f"shape W={width}, D={depth} does not match --world-size "
                                 f"{world_size} and --global-batch-size {global_batch_size}")
            per_replica = global_batch_size // width
            sizes = ([micro_batch_size] if micro_batch_size else
                     [b for b in range(per_replica, 0, -1) if per_replica % b == 0])
            sizes = [b for b in sizes if per_replica % b == 0
                     and _schedule_allows(scheme, depth, per_replica // b)]
            if not sizes:
                continue
            found, fallback = [], None
            for use_recompute in ([recompute] if recompute is not None else [False, True]):
                fitting = []
                for size in sizes:
                    # Memory needs only the lowered schedule; simulate fitting sizes only.
                    memory = memory_per_worker(model, hardware, scheme, depth,
                                               per_replica // size, size, use_recompute)
                    fallback = (size, use_recompute)
                    if max(memory) > hardware.device_memory_bytes:
                        continue
                    fitting.append(evaluate(model, hardware, scheme, width, depth, size,
                                            per_replica // size, use_recompute,
                                            grad_sync_policy, stage_balance))
                    if micro_batch_policy == "largest":
                        break
                if fitting:
                    found.append(max(fitting, key=lambda e: e.throughput))
            if not found:
                size, use_recompute = fallback
                found = [evaluate(model, hardware, scheme, width, depth, size,
                                  per_replica // size, use_recompute, grad_sync_policy,
                                  stage_balance)]
            estimates.extend(found)
    estimates.sort(key=lambda e: (not e.fits, -e.throughput))
    return estimates


def compare_schemes(model: ModelSpec, hardware: HardwareSpec, data_parallel: int,
                    num_stages: int, micro_batch_size: int, num_microbatches: int,
                    recompute: bool, schemes=tuple(SCHEMES),
                    grad_sync_policy: str = "eager-opt",
                    stage_balance: str = "balanced") -> list[Estimate]:
    """The same (W, D, B, N, recompute) under each scheme the schedule constraints allow."""
    return [evaluate(model, hardware, scheme, data_parallel, num_stages, micro_batch_size,
                     num_microbatches, recompute, grad_sync_policy, stage_balance)
            for scheme in schemes if _schedule_allows(scheme, num_stages, num_microbatches)]


__all__ = [
    "SCHEMES", "ModelSpec", "HardwareSpec", "StageCosts", "Estimate", "layer_parameters",
    "stage_parameters", "total_parameters", "layer_forward_flops", "output_layer_forward_flops",
    "stage_forward_flops", "activation_bytes_per_layer", "activation_bytes", "p2p_time",
    "allreduce_time", "num_replicas", "stage_costs", "critical_path_counts",
    "exposed_allreduce", "closed_form_iteration_time", "lowered_schedule",
    "peak_stored_microbatches", "simulated_iteration_time", "memory_per_worker", "evaluate",
    "valid_shapes", "search_configurations", "compare_schemes",
]
