"""The schemes the model compares and the one place a scheme becomes a lowered schedule.

Schedule-backed schemes come from the schedule registry: every family contributes the option
sets of its record's ``model_variants`` as schemes named ``family name + suffix`` (built-in:
``gpipe``, ``1f1b``, ``interleaved-1f1b`` with 2 chunks per rank, ``chimera-direct`` and the other
Chimera variants). They are built, validated and lowered by the pure planning code, so a family
added with ``BUILTIN_SCHEDULES.with_family(...)`` is modelled by passing that registry
(``registry=``) to these functions. GEMS, PipeDream and PipeDream-2BW are not runtime schedules
and are modelled analytically in :mod:`megatron.performance_model.baselines`.

Micro-batch counts: a scheme is costed per *instruction* micro-batch (an op of one stage). For a
family whose layout runs fractions of a micro-batch (Chimera backward halving: halves), B x N
becomes micro-batches of B x fraction, N / fraction of them
(:func:`schedule_microbatches`); ``num_microbatches`` below is that instruction count.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from megatron.performance_model.specs import HardwareSpec
from megatron.core.pipeline_parallel.planning.schedules import (
    BUILTIN_SCHEDULES, ScheduleLayout, ScheduleRegistry, check_schedule_options, resolve_schedule)

# Analytic baselines (no runtime schedule): pipelines holding each stage per replica unit.
ANALYTIC_PIPELINES = {"gems": 2, "pipedream": 1, "pipedream-2bw": 1}
ANALYTIC_SCHEMES = tuple(ANALYTIC_PIPELINES)
#: Schemes whose authors' runtime syncs gradients through DistributedDataParallel (25 MiB
#: buckets, one all-reduce each); GEMS and Chimera all-reduce whole flattened chunks.
DDP_SCHEMES = ("pipedream", "pipedream-2bw")
#: Schemes whose runtime never recomputes the last stage: the authors' PipeDream/PipeDream-2BW
#: ``main_with_runtime.py`` sets ``recompute_step = args.recompute_step and r.stage !=
#: (r.num_stages - 1)`` (github.com/Shigangli/Chimera@ChimeraBk, baselines/gpt2_pipedream2bw);
#: its Chimera and GPipe paths recompute every stage.
LAST_STAGE_NOT_RECOMPUTED = DDP_SCHEMES


def last_stage_kept(scheme: str, hardware: HardwareSpec) -> bool:
    """Whether ``scheme``'s last stage never recomputes: the PipeDream runtimes
    (:data:`LAST_STAGE_NOT_RECOMPUTED`) and the schedule-backed schemes the hardware profile's
    runtime runs so (``HardwareSpec.last_stage_kept``)."""
    return scheme in LAST_STAGE_NOT_RECOMPUTED or scheme in hardware.last_stage_kept


def scheme_table(registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """Scheme name -> (schedule family name, options), None for an analytic baseline."""
    table = {family.name + suffix: (family.name, dict(options))
             for family in registry.families for suffix, options in family.model_variants}
    table.update({name: None for name in ANALYTIC_SCHEMES})
    return table


SCHEMES = scheme_table()  # the built-in families' schemes and the baselines


def schedule_of(scheme: str, registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """(schedule name, options) of a schedule-backed scheme; clear error otherwise."""
    table = SCHEMES if registry is BUILTIN_SCHEDULES else scheme_table(registry)
    if scheme not in table:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {', '.join(table)}")
    if table[scheme] is None:
        raise ValueError(f"scheme {scheme!r} is modelled analytically and has no schedule")
    return table[scheme]


def scheme_layout(scheme: str, num_stages: int,
                  registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> ScheduleLayout:
    """The static layout (pipelines, model stages per rank) of a schedule-backed scheme at D."""
    name, options = schedule_of(scheme, registry)
    family, resolved = resolve_schedule(name, num_stages, None, options, registry)
    return family.layout(num_stages, **resolved)


def model_stages(scheme: str, num_stages: int,
                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> int:
    """Model stages S the layers are split into: D, or D x chunks per rank (interleaved)."""
    if scheme in ANALYTIC_SCHEMES:
        return num_stages
    return scheme_layout(scheme, num_stages, registry).num_stages


def _smallest_depth(scheme: str, registry: ScheduleRegistry) -> int:
    for depth in range(1, 1025):
        try:
            scheme_layout(scheme, depth, registry)
        except ValueError:
            continue
        return depth
    raise ValueError(f"scheme {scheme!r} accepts no pipeline depth up to 1024")


def num_pipelines(scheme: str, num_stages: int | None = None,
                  registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> int:
    """Pipelines per replica unit: the layout's (2f for Chimera), 2 for GEMS, else 1.
    ``num_stages`` None: the layout at the smallest depth the scheme accepts."""
    if scheme in ANALYTIC_PIPELINES:
        return ANALYTIC_PIPELINES[scheme]
    depth = num_stages if num_stages is not None else _smallest_depth(scheme, registry)
    return scheme_layout(scheme, depth, registry).num_pipelines


def num_replicas(scheme: str, data_parallel: int, num_stages: int | None = None,
                 registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> int:
    """Ranks holding one stage: pipelines per unit × W (2W for 2-pipeline Chimera)."""
    if scheme not in ANALYTIC_PIPELINES:
        schedule_of(scheme, registry)  # clear error for an unknown scheme
    return num_pipelines(scheme, num_stages, registry) * data_parallel


def _microbatch_fraction(scheme: str, num_stages: int, registry: ScheduleRegistry) -> Fraction:
    if scheme in ANALYTIC_SCHEMES:
        return Fraction(1)
    return scheme_layout(scheme, num_stages, registry).microbatch_fraction


def schedule_microbatches(scheme: str, num_stages: int, micro_batch_size: int,
                          num_microbatches: int,
                          registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """(instruction micro-batch size, instruction micro-batch count): backward halving runs
    micro-batches of B/2, twice as many (chimera.md §3); other schemes B and N."""
    fraction = _microbatch_fraction(scheme, num_stages, registry)
    size = micro_batch_size * fraction
    if size.denominator != 1:
        needed = ("an even micro-batch size" if fraction.denominator == 2
                  else f"a micro-batch size divisible by {fraction.denominator}")
        raise ValueError(f"{scheme} needs {needed} (got {micro_batch_size}): its ops run "
                         f"micro-batches of {fraction} of it")
    return int(size), int(num_microbatches / fraction)


def _plan_microbatches(scheme: str, num_stages: int, num_microbatches: int,
                       registry: ScheduleRegistry) -> int:
    """Micro-batches of B the family is asked to build for ``num_microbatches`` instruction
    micro-batches (the inverse of :func:`schedule_microbatches`)."""
    count = num_microbatches * _microbatch_fraction(scheme, num_stages, registry)
    if count.denominator != 1:
        raise ValueError(f"{scheme} needs an instruction micro-batch count divisible by "
                         f"{count.denominator} (got {num_microbatches})")
    return int(count)


def check_schedule(scheme: str, num_stages: int, num_microbatches: int,
                   registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> None:
    """Raise ValueError where the schedule cannot run (D, N) (analytic schemes: any N >= 1)."""
    if scheme in ANALYTIC_SCHEMES:
        if num_microbatches < 1:
            raise ValueError(f"{scheme} needs at least one micro-batch")
        if scheme == "gems" and num_microbatches % 2:
            raise ValueError(f"gems alternates two replicas: N must be even (got {num_microbatches})")
        if scheme == "pipedream-2bw" and num_microbatches < num_stages:
            raise ValueError(f"pipedream-2bw updates every N >= D micro-batches (two weight "
                             f"versions suffice only then); got N={num_microbatches}, "
                             f"D={num_stages}")
        return
    name, options = schedule_of(scheme, registry)
    check_schedule_options(name, num_stages,
                           _plan_microbatches(scheme, num_stages, num_microbatches, registry),
                           registry=registry, **options)


def schedule_allows(scheme: str, num_stages: int, num_microbatches: int,
                    registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> bool:
    try:
        check_schedule(scheme, num_stages, num_microbatches, registry)
    except ValueError:
        return False
    return True


def critical_path(scheme: str, num_stages: int, num_microbatches: int,
                  registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """The family's closed-form (Cf, Cb) (its record's ``critical_path``), or None."""
    name, options = schedule_of(scheme, registry)
    family, resolved = resolve_schedule(name, num_stages, None, options, registry)
    return family.critical_path(num_stages, num_microbatches, **resolved)


def lowered_schedule(scheme: str, num_stages: int, num_microbatches: int,
                     grad_sync_policy: str = "eager-opt",
                     registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """(layout, lowered op lists) of a scheme, from the planning package's frozen plan. Cached."""
    return _lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy, registry)


@lru_cache(maxsize=256)
def _lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy, registry):
    from megatron.core.pipeline_parallel.planning.plan import make_plan

    name, options = schedule_of(scheme, registry)
    plan = make_plan(name, num_stages,
                     _plan_microbatches(scheme, num_stages, num_microbatches, registry), options,
                     grad_sync_policy=grad_sync_policy, registry=registry)
    return plan.layout, plan.lowered
