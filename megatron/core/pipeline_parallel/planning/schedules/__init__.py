"""Pipeline schedules as data: pure builders of per-rank instruction lists (no torch import).

Every schedule family is one :class:`~.family.ScheduleFamily` record (name, options, check,
builder, layout, viewer label, what checkpoints need); ``BUILTIN_SCHEDULES`` holds the project's
families and every list of names derives from it. The functions below take the family by name
from ``registry`` (default: the built-in one); pass a registry made with
``BUILTIN_SCHEDULES.with_family(...)`` to use a family of your own.

* ``build_schedule(name, pipeline_size, num_microbatches, **options)`` -> one list of
  :class:`~megatron.core.pipeline_parallel.planning.instructions.Instruction` per pipeline rank.
* ``check_schedule_options(name, pipeline_size, num_microbatches, **options)`` raises
  ValueError (saying what is allowed) for a bad configuration; call it before creating groups.
* ``schedule_layout(name, pipeline_size, **options)`` -> :class:`ScheduleLayout` (placement,
  modules per rank, micro-batch -> samples mapping).
* ``schedule_from_config(config.parallel)`` -> the name and options Megatron's flags select.

Options that belong to another family (e.g. ``num_pipelines`` given to ``1f1b``) and options
whose value is None are ignored, so an argument parser can pass all of them; option names no
family knows raise ValueError. Most callers want :func:`~..plan.make_plan`, which resolves all
of this once.
"""

from __future__ import annotations

from ..instructions import Instruction
from .chimera import VARIANTS as CHIMERA_VARIANTS
from .family import ScheduleFamily, ScheduleOption, ScheduleRegistry
from .layout import ScheduleLayout
from .registry import BUILTIN_SCHEDULES

SCHEDULE_NAMES = BUILTIN_SCHEDULES.names

__all__ = ["BUILTIN_SCHEDULES", "CHIMERA_VARIANTS", "SCHEDULE_NAMES", "ScheduleFamily",
           "ScheduleLayout", "ScheduleOption", "ScheduleRegistry", "build_schedule",
           "check_schedule_options", "family_options", "resolve_schedule",
           "schedule_from_config", "schedule_layout", "placement"]


def _check_positive(pipeline_size, num_microbatches) -> None:
    if not isinstance(pipeline_size, int) or pipeline_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be a positive int, "
                         f"got {pipeline_size!r}")
    if num_microbatches is not None and (not isinstance(num_microbatches, int)
                                         or num_microbatches < 1):
        raise ValueError(f"the number of micro-batches must be a positive int, "
                         f"got {num_microbatches!r}")


def resolve_schedule(name: str, pipeline_size, num_microbatches, options: dict,
                     registry: ScheduleRegistry = BUILTIN_SCHEDULES
                     ) -> tuple[ScheduleFamily, dict]:
    """Check everything; return the family and its options with defaults filled in.

    ``num_microbatches`` None checks only what does not depend on N (for a layout).
    """
    family = registry.family(name)
    unknown = sorted(set(options) - set(registry.option_names()))
    if unknown:
        raise ValueError(f"unknown schedule option(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(registry.option_names())}")
    _check_positive(pipeline_size, num_microbatches)
    resolved = family.defaults()
    resolved.update({key: value for key, value in options.items()
                     if key in resolved and value is not None})
    checked = resolved
    if num_microbatches is None:  # options bounded by N are checked when the schedule is built
        checked = {key: value for key, value in resolved.items()
                   if not family.option(key).bounded_by_microbatches}
    family.check(pipeline_size, pipeline_size if num_microbatches is None else num_microbatches,
                 **checked)
    return family, resolved


def family_options(name: str, registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                   **options) -> dict:
    """Of ``options``, the ones schedule ``name`` understands (other families' and None dropped)."""
    understood = {option.name for option in registry.family(name).options}
    return {key: value for key, value in options.items()
            if key in understood and value is not None}


def schedule_from_config(parallel_config,
                         registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> tuple[str, dict]:
    """The schedule name and builder options that ``config.parallel`` (Megatron's flags) selects."""
    name = parallel_config.pipeline_schedule or registry.default_name
    return name, registry.family(name).options_from_config(parallel_config)


def check_schedule_options(name: str, pipeline_size: int, num_microbatches: int,
                           micro_batch_size: int | None = None,
                           registry: ScheduleRegistry = BUILTIN_SCHEDULES, **options) -> None:
    """Raise ValueError with the allowed values if the schedule cannot be built.

    ``micro_batch_size`` (optional) is checked against the instruction micro-batch size: backward
    halving needs it even.
    """
    family, resolved = resolve_schedule(name, pipeline_size, num_microbatches, options, registry)
    if micro_batch_size is not None:
        layout = family.layout(pipeline_size, **resolved)
        layout.microbatch_samples(0, micro_batch_size)  # raises ValueError when not divisible


def build_schedule(name: str, pipeline_size: int, num_microbatches: int,
                   registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                   **options) -> list[list[Instruction]]:
    """Per pipeline rank, the ordered compute instructions of one training iteration.

    ``num_microbatches`` is N, the number of micro-batches of --micro-batch-size per
    data-parallel rank per iteration (both Chimera directions together).
    """
    family, resolved = resolve_schedule(name, pipeline_size, num_microbatches, options, registry)
    return family.build(pipeline_size, num_microbatches, **resolved)


def schedule_layout(name: str, pipeline_size: int,
                    registry: ScheduleRegistry = BUILTIN_SCHEDULES, **options) -> ScheduleLayout:
    """Static layout of a schedule family: stages, placement, modules per rank, sample mapping."""
    family, resolved = resolve_schedule(name, pipeline_size, None, options, registry)
    return family.layout(pipeline_size, **resolved)


def placement(name: str, pipeline_size: int, pipeline: int, stage: int,
              registry: ScheduleRegistry = BUILTIN_SCHEDULES, **options) -> int:
    """Pipeline rank that hosts ``stage`` of ``pipeline`` in schedule ``name``."""
    return schedule_layout(name, pipeline_size, registry, **options).placement(pipeline, stage)
