"""Predict configurations and search them: (W, D, B, recomputation, scheme/variant/pipelines)
under a memory limit, ranked by predicted throughput, with the launch flags of each."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.performance_model.baselines import BASELINE_TIMES, baseline_memory
from megatron.performance_model.costs import StageCosts
from megatron.performance_model.memory import memory_per_worker
from megatron.core.pipeline_parallel.planning.schedules import (
    BUILTIN_SCHEDULES, ScheduleRegistry, resolve_schedule)
from megatron.performance_model.schemes import (
    ANALYTIC_SCHEMES, SCHEMES, check_schedule, model_stages, num_replicas, schedule_allows,
    schedule_microbatches, schedule_of, scheme_layout)
from megatron.performance_model.specs import RECOMPUTE_MODES, HardwareSpec, ModelSpec, recompute_mode
from megatron.performance_model.timing import (
    closed_form_iteration_time, simulated_iteration_time, stage_costs)


@dataclass
class Estimate:
    """Prediction for one configuration; times in seconds, memory in bytes."""

    scheme: str
    data_parallel: int  # W
    pipeline: int  # D
    micro_batch_size: int  # B
    num_microbatches: int  # N
    recompute: str  # none / selective / full
    global_batch_size: int
    closed_form_time: float | None
    simulated_time: float
    memory_per_worker: list = field(default_factory=list)
    device_memory_bytes: float = 0.0
    costs: StageCosts | None = None
    num_layers: int = 0  # of the model (the launch flags of interleaved 1F1B need it)

    @property
    def iteration_time(self) -> float:
        """The ranking time: the simulator's (or the analytic baseline's)."""
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


def evaluate(model: ModelSpec, hardware: HardwareSpec, scheme: str, data_parallel: int,
             num_stages: int, micro_batch_size: int, num_microbatches: int, recompute,
             grad_sync_policy: str = "eager-opt", stage_balance: str = "balanced",
             distributed_optimizer: bool = False,
             registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> Estimate:
    """Predict one configuration: time (closed form and simulator, or the analytic baseline)
    and memory per worker. Backward halving is costed at micro-batches of B/2, 2N of them.
    ``registry``: the schedule families whose schemes may be named (see :mod:`.schemes`)."""
    mode = recompute_mode(recompute)
    size, count = schedule_microbatches(scheme, num_stages, micro_batch_size, num_microbatches,
                                        registry)
    check_schedule(scheme, num_stages, count, registry)
    costs = stage_costs(model, hardware, scheme, data_parallel, num_stages, size, mode,
                        stage_balance, registry)
    if scheme in ANALYTIC_SCHEMES:
        closed = simulated = BASELINE_TIMES[scheme](num_stages, count, costs)
        memory = baseline_memory(model, hardware, scheme, num_stages, size, mode,
                                 num_replicas(scheme, data_parallel))
    else:
        closed = closed_form_iteration_time(scheme, num_stages, count, costs, grad_sync_policy,
                                            registry)
        simulated = simulated_iteration_time(scheme, num_stages, count, costs, grad_sync_policy,
                                             registry)
        memory = memory_per_worker(model, hardware, scheme, num_stages, count, size, mode,
                                   data_parallel, distributed_optimizer, registry)
    return Estimate(scheme, data_parallel, num_stages, micro_batch_size, num_microbatches, mode,
                    data_parallel * micro_batch_size * num_microbatches, closed, simulated,
                    memory, hardware.device_memory_bytes, costs, model.num_layers)


def valid_shapes(scheme: str, world_size: int, num_layers: int, global_batch_size: int,
                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> list:
    """(W, D) pairs with W·D = P, the scheme's model stages (D, or D x chunks) dividing the
    layers, W dividing the mini-batch, and D one the scheme's layout accepts (even for
    Chimera)."""
    shapes = []
    for depth in range(1, world_size + 1):
        if world_size % depth or global_batch_size % (world_size // depth):
            continue
        try:
            stages = model_stages(scheme, depth, registry)
        except ValueError:
            continue  # the family refuses this depth
        if num_layers % stages:
            continue
        shapes.append((world_size // depth, depth))
    return shapes


def _micro_batch_sizes(scheme, depth, per_replica, micro_batch_size, registry):
    sizes = ([micro_batch_size] if micro_batch_size else
             [b for b in range(per_replica, 0, -1) if per_replica % b == 0])
    allowed = []
    for size in sizes:
        if per_replica % size:
            continue
        try:
            _, count = schedule_microbatches(scheme, depth, size, per_replica // size, registry)
        except ValueError:
            continue
        if schedule_allows(scheme, depth, count, registry):
            allowed.append(size)
    return allowed


def _best_for_shape(model, hardware, scheme, width, depth, sizes, modes, per_replica, policy,
                    options) -> list:
    """The best fitting B per recomputation mode, or one non-fitting estimate saying why."""
    found, fallback = [], None
    for mode in modes:
        fitting = []
        for size in sizes:
            estimate = evaluate(model, hardware, scheme, width, depth, size, per_replica // size,
                                mode, **options)
            fallback = fallback or estimate
            if estimate.fits:
                fitting.append(estimate)
                if policy == "largest":
                    break
        if fitting:
            found.append(max(fitting, key=lambda e: e.throughput))
    return found or ([fallback] if fallback else [])


def search_configurations(model: ModelSpec, hardware: HardwareSpec, world_size: int,
                          global_batch_size: int, schemes=("chimera-direct",),
                          micro_batch_size: int | None = None, recompute=None,
                          grad_sync_policy: str = "eager-opt", stage_balance: str = "balanced",
                          micro_batch_policy: str = "fastest", shapes=None,
                          recompute_modes=("none", "full"),
                          distributed_optimizer: bool = False,
                          registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> list[Estimate]:
    """Rank configurations by predicted throughput (sequences/s, highest first).

    For each scheme and valid (W, D) (or the given ``shapes``): N·B = mini-batch / W, B a divisor
    allowed by the schedule (or ``micro_batch_size``); each of ``recompute_modes`` (or only
    ``recompute``). Per (scheme, W, D, recomputation) one B is kept: ``largest`` the largest
    that fits (the paper's rule), ``fastest`` the fitting B with the highest throughput. A
    shape where nothing fits appears once with fits False. Fitting configurations rank first.
    """
    if world_size < 1 or global_batch_size < 1:
        raise ValueError("--world-size and --global-batch-size must be positive")
    if micro_batch_policy not in ("largest", "fastest"):
        raise ValueError(f"unknown micro-batch policy {micro_batch_policy!r}; "
                         "use 'largest' or 'fastest'")
    modes = [recompute_mode(recompute)] if recompute is not None else list(recompute_modes)
    options = {"grad_sync_policy": grad_sync_policy, "stage_balance": stage_balance,
               "distributed_optimizer": distributed_optimizer, "registry": registry}
    estimates = []
    for scheme in schemes:
        for width, depth in shapes or valid_shapes(scheme, world_size, model.num_layers,
                                                   global_batch_size, registry):
            if width * depth != world_size or global_batch_size % width:
                raise ValueError(f"shape W={width}, D={depth} does not match --world-size "
                                 f"{world_size} and --global-batch-size {global_batch_size}")
            per_replica = global_batch_size // width
            sizes = _micro_batch_sizes(scheme, depth, per_replica, micro_batch_size, registry)
            estimates.extend(_best_for_shape(model, hardware, scheme, width, depth, sizes, modes,
                                             per_replica, micro_batch_policy, options))
    estimates.sort(key=lambda e: (not e.fits, -e.throughput))
    return estimates


def compare_schemes(model: ModelSpec, hardware: HardwareSpec, data_parallel: int,
                    num_stages: int, micro_batch_size: int, num_microbatches: int,
                    recompute, schemes=tuple(SCHEMES), **options) -> list[Estimate]:
    """The same (W, D, B, N, recomputation) under each scheme whose constraints allow it."""
    estimates = []
    for scheme in schemes:
        try:
            estimates.append(evaluate(model, hardware, scheme, data_parallel, num_stages,
                                      micro_batch_size, num_microbatches, recompute, **options))
        except ValueError:
            continue
    return estimates


def launch_flags(estimate: Estimate, grad_sync_policy: str = "eager-opt",
                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> str:
    """pretrain_gpt.py flags for a schedule-backed estimate (analytic baselines: none): the
    schedule, the flags its family's record derives from the scheme's options
    (``config_flags``) and, where stages have replicas, the gradient-sync policy."""
    if estimate.scheme in ANALYTIC_SCHEMES:
        return f"({estimate.scheme} is modelled only; this project does not run it)"
    name, options = schedule_of(estimate.scheme, registry)
    family, resolved = resolve_schedule(name, estimate.pipeline, None, options, registry)
    flags = [f"--pipeline-model-parallel-size {estimate.pipeline}", f"--pipeline-schedule {name}"]
    flags += [" ".join(family.config_flags(family, resolved, estimate.num_layers,
                                           estimate.pipeline))]
    if scheme_layout(estimate.scheme, estimate.pipeline, registry).has_stage_replicas:
        flags.append(f"--chimera-grad-sync {grad_sync_policy}")
    flags += [f"--micro-batch-size {estimate.micro_batch_size}",
              f"--global-batch-size {estimate.global_batch_size}"]
    if estimate.recompute == "full":
        flags.append("--recompute-granularity full --recompute-method uniform "
                     "--recompute-num-layers 1")
    elif estimate.recompute == "selective":
        flags.append("--recompute-granularity selective")
    return " ".join(flag for flag in flags if flag)


__all__ = ["Estimate", "evaluate", "valid_shapes", "search_configurations", "compare_schemes",
           "launch_flags", "RECOMPUTE_MODES"]
