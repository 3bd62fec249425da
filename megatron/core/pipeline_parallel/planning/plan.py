"""One resolved pipeline plan: schedule, layout and lowered op lists, built once and passed on.

``make_plan`` composes build -> validate -> lower for a schedule family; ``plan_from_config`` does
it for Megatron's flags. The runtime, the simulator, the performance model, the schedule viewer
and the checkpoint tools all consume the resulting :class:`PipelinePlan` instead of composing the
steps themselves. ``layout_from_config`` gives the static layout alone (no N needed), for code
that only places stages (checkpoint conversion, process-group creation). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional

from .lowering import GRAD_SYNC_POLICIES, lower_schedule
from .op_costs import StageCosts, uniform_stage_costs
from .schedules import BUILTIN_SCHEDULES, ScheduleFamily, ScheduleLayout, ScheduleRegistry
from .schedules import resolve_schedule, schedule_from_config
from .schedules.split_backward import split_backward_schedule
from .validator import validate_schedule


@dataclass(frozen=True)
class PipelinePlan:
    """A schedule resolved for one (D, N, options, grad-sync policy): immutable.

    Attributes:
        family: the schedule family record.
        options: the family's options with defaults filled in.
        pipeline_size: D.
        num_microbatches: N micro-batches of --micro-batch-size per data-parallel rank.
        layout: static placement of the stages.
        schedule: per rank, the compute instructions (validated).
        lowered: per rank, compute + p2p groups + gradient-sync ops (what the runtime runs).
        grad_sync_policy: when stage replicas start their gradient all-reduce.
        split_backward: extra activations allowed for the split backward's deferred weight work,
            or None when backwards are not split.
        stage_costs: the per-stage charges the split planner placed the weight work with (per
            micro-batch of --micro-batch-size; None when backwards are not split).
    """

    family: ScheduleFamily
    options: Mapping
    pipeline_size: int
    num_microbatches: int
    layout: ScheduleLayout
    schedule: tuple
    lowered: tuple
    grad_sync_policy: str
    split_backward: Optional[int] = None
    stage_costs: Optional[StageCosts] = None

    @property
    def name(self) -> str:
        return self.family.name

    @cached_property
    def forward_only(self) -> tuple:
        """Per rank, the ops of a forward-only pass (evaluation): forwards and activations."""
        from .lowering import forward_only_ops
        return tuple(tuple(forward_only_ops(ops)) for ops in self.lowered)

    def describe(self) -> str:
        """``chimera (num_pipelines=2, variant=direct), 2 pipeline(s) x 4 stages, grad sync ...``"""
        details = ", ".join(f"{key}={value}" for key, value in self.options.items())
        split = ("" if self.split_backward is None else
                 f", split backward (weight work deferred, up to {self.split_backward} extra "
                 f"stored micro-batches)")
        return (f"{self.name}" + (f" ({details})" if details else "")
                + f", {self.layout.num_pipelines} pipeline(s) x {self.layout.num_stages} stages, "
                f"grad sync {self.grad_sync_policy}{split}")

    def op_label(self, op) -> str:
        """Short label of a compute op for grids and pictures: kind, micro-batch, family suffix."""
        return f"{op.kind.value}{op.microbatch}" + self.family.op_label(op, dict(self.options))


def make_plan(name: str, pipeline_size: int, num_microbatches: int,
              options: Optional[Mapping] = None, *, grad_sync_policy: str = "eager-opt",
              forward_cost: float = 1, backward_cost: float = 2,
              doubled_step_messages: bool = False, split_backward: Optional[int] = None,
              stage_costs: Optional[StageCosts] = None,
              registry: ScheduleRegistry = BUILTIN_SCHEDULES,
              eager_sends: Optional[bool] = None) -> PipelinePlan:
    """Build, validate and lower one schedule.

    ``forward_cost`` / ``backward_cost`` (per micro-batch of --micro-batch-size; scaled by the
    layout's micro-batch fraction) only shape where the lowering groups communication.
    ``doubled_step_messages``: the two inputs of a doubled forward step travel together (worth it
    with packing; see :func:`~.lowering.lower_schedule`). ``split_backward`` (extra stored
    activations allowed, or None): split every backward and place the weight halves in idle slots
    (:mod:`.schedules.split_backward`), placed with ``stage_costs`` (per micro-batch of
    --micro-batch-size; default: ``forward_cost`` / ``backward_cost`` on every stage, the first
    stage's whole backward in its weight half, see :mod:`.op_costs`). A ``stage_costs`` with
    message latency δ > 0 makes a latency-tolerant plan: split backward places the weight halves
    knowing that a message arrives δ after its producer, and the lowering sends every message
    right after its producer (with δ = 0 the plan is the free-message one, unchanged).
    ``eager_sends``: send every message right after its producer (True) or at its round's group
    (False); None: eagerly exactly for a plan with message latency > 0. The runtime asks for
    eager sends wherever sends complete in the background (gloo): the compute order is the same
    and, messages being free in the plan, so is the simulated makespan, while a real message
    gets its round's slack to travel instead of being posted just before its consumer needs it
    (docs/benchmarks.md §9, "Eager sends on gloo").
    """
    if grad_sync_policy not in GRAD_SYNC_POLICIES:
        raise ValueError(f"unknown gradient sync policy {grad_sync_policy!r}; allowed: "
                         f"{', '.join(GRAD_SYNC_POLICIES)}")
    family, resolved = resolve_schedule(name, pipeline_size, num_microbatches,
                                        dict(options or {}), registry)
    layout = family.layout(pipeline_size, **resolved)
    schedule = family.build(pipeline_size, num_microbatches, **resolved)
    fraction = float(layout.microbatch_fraction)
    # A plan for message latency > 0 sends each message right after its producer.
    if eager_sends is None:
        eager_sends = stage_costs is not None and stage_costs.message_latency > 0
    if split_backward is not None:
        validate_schedule(schedule, layout, num_microbatches)
        if stage_costs is None:
            stage_costs = uniform_stage_costs(layout.num_stages, forward_cost, backward_cost)
        schedule = split_backward_schedule(schedule, layout.num_stages, split_backward,
                                           stage_costs.scaled(fraction))
    else:
        stage_costs = None
    validate_schedule(schedule, layout, num_microbatches)
    lowered = lower_schedule(schedule, layout, grad_sync_policy, forward_cost * fraction,
                             backward_cost * fraction, doubled_step_messages=doubled_step_messages,
                             stage_costs=None if stage_costs is None
                             else stage_costs.scaled(fraction), eager_sends=eager_sends)
    return PipelinePlan(family, resolved, pipeline_size, num_microbatches, layout,
                        tuple(tuple(ops) for ops in schedule),
                        tuple(tuple(ops) for ops in lowered), grad_sync_policy, split_backward,
                        stage_costs)


def plan_from_config(config, *, doubled_step_messages: bool = False,
                     registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                     num_microbatches: Optional[int] = None,
                     eager_sends: Optional[bool] = None) -> PipelinePlan:
    """The plan of the configured schedule (``config.parallel``, ``config.training``), for
    ``num_microbatches`` micro-batches per iteration (default: the configured full batch's; a
    batch-size ramp-up runs smaller counts first). ``eager_sends`` as in :func:`make_plan`."""
    parallel = config.parallel
    name, options = schedule_from_config(parallel, registry)
    stage_costs = None
    if getattr(parallel, "pipeline_op_costs", None):
        from .op_cost_profile import load_stage_costs
        layout = layout_from_config(config, registry)
        num_layers = getattr(config.model, "num_layers", None) or layout.num_stages
        stage_costs = load_stage_costs(
            parallel.pipeline_op_costs, layout.num_stages, parallel.pipeline_model_parallel_size,
            stage_layers=[max(1, num_layers // layout.num_stages)] * layout.num_stages,
            micro_batch_size=config.training.micro_batch_size)
    return make_plan(name, parallel.pipeline_model_parallel_size,
                     num_microbatches or config.training.num_microbatches, options,
                     grad_sync_policy=parallel.chimera_grad_sync,
                     doubled_step_messages=doubled_step_messages,
                     split_backward=(parallel.split_backward_extra_activations
                                     if parallel.split_backward else None),
                     stage_costs=stage_costs, registry=registry, eager_sends=eager_sends)


def layout_from_config(config, registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> ScheduleLayout:
    """The static layout of the configured schedule (no micro-batch count needed)."""
    parallel = config.parallel
    name, options = schedule_from_config(parallel, registry)
    family, resolved = resolve_schedule(name, parallel.pipeline_model_parallel_size, None,
                                        options, registry)
    return family.layout(parallel.pipeline_model_parallel_size, **resolved)
