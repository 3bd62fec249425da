"""Pipeline schedules as data: pure builders of per-rank instruction lists (no torch import).

Public API:

* ``build_schedule(name, pipeline_size, num_microbatches, **options)`` -> one list of
  :class:`~megatron.core.pipeline_parallel.planning.instructions.Instruction` per pipeline rank.
* ``check_schedule_options(name, pipeline_size, num_microbatches, **options)`` raises
  ValueError (saying what is allowed) for a bad configuration; call it before creating groups.
* ``schedule_layout(name, pipeline_size, **options)`` -> :class:`ScheduleLayout` (placement,
  modules per rank, micro-batch -> samples mapping).
* ``placement(name, pipeline_size, pipeline, stage, **options)`` -> pipeline rank.

Names and options:

* ``gpipe``, ``1f1b``: no options.
* ``interleaved-1f1b``: ``num_model_chunks`` (v >= 2); N must be a multiple of D.
* ``chimera``: ``num_pipelines`` (2f, default 2, f divides D/2) and ``variant`` in
  ``direct`` (default), ``forward-doubling``, ``backward-halving``; D even.

Options that belong to another family (e.g. ``num_pipelines`` given to ``1f1b``) and options
whose value is None are ignored, so an argument parser can pass all of them; unknown option
names raise ValueError.
"""

from __future__ import annotations

from fractions import Fraction

from ..instructions import Instruction
from .chimera import VARIANTS as CHIMERA_VARIANTS
from .chimera import build_chimera, check_chimera, chimera_placements
from .gpipe import build_gpipe
from .interleaved import build_interleaved, check_interleaved
from .layout import ScheduleLayout
from .one_f_one_b import build_one_f_one_b

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "chimera")

# Options each schedule family understands, with their defaults.
_OPTIONS = {
    "gpipe": {},
    "1f1b": {},
    "interleaved-1f1b": {"num_model_chunks": None},
    "chimera": {"num_pipelines": 2, "variant": "direct"},
}
_ALL_OPTION_NAMES = sorted({key for options in _OPTIONS.values() for key in options})

__all__ = ["SCHEDULE_NAMES", "CHIMERA_VARIANTS", "ScheduleLayout", "build_schedule",
           "check_schedule_options", "family_options", "schedule_from_config", "schedule_layout",
           "placement"]


def _resolve(name: str, pipeline_size, num_microbatches, options: dict) -> dict:
    """Validate everything and return the options of the family ``name`` with defaults."""
    if name not in _OPTIONS:
        raise ValueError(f"unknown pipeline schedule {name!r}; allowed: {', '.join(SCHEDULE_NAMES)}")
    unknown = sorted(set(options) - set(_ALL_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown schedule option(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(_ALL_OPTION_NAMES)}")
    if not isinstance(pipeline_size, int) or pipeline_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be a positive int, "
                         f"got {pipeline_size!r}")
    resolved = dict(_OPTIONS[name])
    resolved.update({key: value for key, value in options.items()
                     if key in resolved and value is not None})
    if num_microbatches is not None:
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"the number of micro-batches must be a positive int, "
                             f"got {num_microbatches!r}")
        if name == "interleaved-1f1b":
            check_interleaved(pipeline_size, num_microbatches, resolved["num_model_chunks"])
        elif name == "chimera":
            check_chimera(pipeline_size, num_microbatches, **resolved)
    else:  # layout only: check the options that do not involve N
        if name == "interleaved-1f1b":
            check_interleaved(pipeline_size, pipeline_size, resolved["num_model_chunks"])
        elif name == "chimera":
            check_chimera(pipeline_size, pipeline_size, **resolved)
    return resolved


def family_options(name: str, **options) -> dict:
    """Of ``options``, the ones schedule ``name`` understands (other families' and None dropped)."""
    understood = _OPTIONS.get(name, {})
    return {key: value for key, value in options.items()
            if key in understood and value is not None}


def schedule_from_config(parallel_config) -> tuple[str, dict]:
    """The schedule name and builder options that ``config.parallel`` (Megatron's flags) selects."""
    name = parallel_config.pipeline_schedule or "1f1b"
    return name, family_options(
        name, num_model_chunks=parallel_config.virtual_pipeline_model_parallel_size,
        num_pipelines=parallel_config.chimera_pipelines, variant=parallel_config.chimera_variant)


def check_schedule_options(name: str, pipeline_size: int, num_microbatches: int,
                           micro_batch_size: int | None = None, **options) -> None:
    """Raise ValueError with the allowed values if the schedule cannot be built.

    ``micro_batch_size`` (optional) is checked against the instruction micro-batch size: backward
    halving needs it even.
    """
    resolved = _resolve(name, pipeline_size, num_microbatches, options)
    if micro_batch_size is not None:
        layout = _layout(name, pipeline_size, resolved)
        layout.microbatch_samples(0, micro_batch_size)  # raises ValueError when not divisible


def build_schedule(name: str, pipeline_size: int, num_microbatches: int,
                   **options) -> list[list[Instruction]]:
    """Per pipeline rank, the ordered compute instructions of one training iteration.

    ``num_microbatches`` is N, the number of micro-batches of --micro-batch-size per
    data-parallel rank per iteration (both Chimera directions together). See the module
    docstring for names and options.
    """
    resolved = _resolve(name, pipeline_size, num_microbatches, options)
    if name == "gpipe":
        return build_gpipe(pipeline_size, num_microbatches)
    if name == "1f1b":
        return build_one_f_one_b(pipeline_size, num_microbatches)
    if name == "interleaved-1f1b":
        return build_interleaved(pipeline_size, num_microbatches, resolved["num_model_chunks"])
    return build_chimera(pipeline_size, num_microbatches, **resolved)


def _layout(name: str, pipeline_size: int, resolved: dict) -> ScheduleLayout:
    depth = pipeline_size
    if name in ("gpipe", "1f1b"):
        return ScheduleLayout(name, depth, depth, (tuple(range(depth)),))
    if name == "interleaved-1f1b":
        num_stages = depth * resolved["num_model_chunks"]
        return ScheduleLayout(name, depth, num_stages,
                              (tuple(stage % depth for stage in range(num_stages)),))
    fraction = Fraction(1, 2) if resolved["variant"] == "backward-halving" else Fraction(1)
    doubling_unit = 2 * depth if resolved["variant"] != "direct" else 0
    return ScheduleLayout(name, depth, depth, chimera_placements(depth, resolved["num_pipelines"]),
                          fraction, doubling_unit)


def schedule_layout(name: str, pipeline_size: int, **options) -> ScheduleLayout:
    """Static layout of a schedule family: stages, placement, modules per rank, sample mapping."""
    return _layout(name, pipeline_size, _resolve(name, pipeline_size, None, options))


def placement(name: str, pipeline_size: int, pipeline: int, stage: int, **options) -> int:
    """Pipeline rank that hosts ``stage`` of ``pipeline`` in schedule ``name``."""
    return schedule_layout(name, pipeline_size, **options).placement(pipeline, stage)
