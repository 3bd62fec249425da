"""One record per schedule family, and the registry every list of schedule names derives from.

A :class:`ScheduleFamily` says everything the rest of the project needs to know about a schedule:
its name, its options (with defaults, the config field each comes from and the flag tools use),
how to check a configuration, how to build the per-rank instruction lists, its static
:class:`~.layout.ScheduleLayout`, how the viewer labels its ops and which options decide what a
checkpoint's files hold. Nothing outside a family's own module branches on its name.

A :class:`ScheduleRegistry` is an immutable collection of families. The project's families form
``BUILTIN_SCHEDULES`` (in :mod:`.registry`); a test or an extension adds its own with
:meth:`ScheduleRegistry.with_family` and passes the new registry explicitly (no global state).
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..instructions import Instruction
from ..stage_split import StageSplit, stage_layer_counts
from .layout import ScheduleLayout


@dataclass(frozen=True)
class ScheduleOption:
    """One builder option of a schedule family.

    Attributes:
        name: keyword of the builder, the check and the layout functions.
        default: value used when neither the config nor the caller gives one (None: required
            from the config, e.g. the number of interleaved model chunks).
        config_field: field of ``config.parallel`` the option is read from.
        flag: command-line flag of the tools that take schedule options (the viewer).
        type: converter of the flag's value.
        choices: allowed values, or None.
        help: one line for ``--help``.
        tool_default: value tools use when the flag is not given (None: ``default``).
        bounded_by_microbatches: the option's valid values depend on the number of
            micro-batches N, so a check without N (a layout's) leaves it out.
    """

    name: str
    default: Any
    config_field: str
    flag: str
    type: Callable = str
    choices: Optional[tuple] = None
    help: str = ""
    tool_default: Any = None
    bounded_by_microbatches: bool = False

    @property
    def default_for_tools(self) -> Any:
        return self.default if self.tool_default is None else self.tool_default


def _no_check(pipeline_size: int, num_microbatches: int, **options) -> None:
    """Families without constraints beyond positive D and N accept everything."""


def _no_label(op: Instruction, options: dict) -> str:
    return ""


def even_stage_config(parallel_config, num_layers: int) -> dict:
    """Config rule of a family whose ranks hold one stage each (the default ``derive_config``):
    the layers must split evenly over the D stages, or as the uneven-stage flags say
    (:mod:`..stage_split`); nothing is derived."""
    pp = parallel_config.pipeline_model_parallel_size
    split = StageSplit.from_parallel_config(parallel_config)
    if not split.is_even:
        stage_layer_counts(num_layers, pp, pp, split)
        return {}
    if num_layers % pp:
        raise ValueError(f"--num-layers {num_layers} is not divisible by "
                         f"--pipeline-model-parallel-size {pp}; choose a multiple of {pp}, or "
                         f"give the first and/or last stage its own count with "
                         f"--decoder-first-pipeline-num-layers / "
                         f"--decoder-last-pipeline-num-layers (the rest split evenly)")
    return {}


def option_flags(family: "ScheduleFamily", options: dict, num_layers: int,
                 pipeline_size: int) -> list[str]:
    """Command-line flags that select ``options``: each option's config field as a flag."""
    flags = []
    for option in family.options:
        if options.get(option.name) is not None:
            flags += ["--" + option.config_field.replace("_", "-"), str(options[option.name])]
    return flags


def one_op_per_slot(pipeline_size: int, num_microbatches: int, **options) -> None:
    """No closed-form critical path is known (the performance model simulates the plan)."""
    return None


@dataclass(frozen=True)
class ScheduleFamily:
    """Everything about one schedule family (see the module docstring).

    Attributes:
        name: the ``--pipeline-schedule`` value.
        description: one line for ``--help`` and the viewer.
        build: ``build(pipeline_size, num_microbatches, **options)`` -> per-rank instructions.
        layout: ``layout(pipeline_size, **options)`` -> :class:`ScheduleLayout`.
        options: the family's options.
        check: ``check(pipeline_size, num_microbatches, **options)`` raises ValueError saying
            what is allowed; called before any process group exists.
        op_label: ``op_label(op, options)`` -> suffix of the viewer's label of ``op`` after its
            kind and micro-batch (e.g. Chimera's direction arrow).
        checkpoint_options: option names whose value changes which weights a rank's checkpoint
            files hold (recorded in and compared against a checkpoint's layout).
        memory_note: ``memory_note(options)`` -> a warning to log when activation recomputation
            is off, or None.
        selected_by: ``config.parallel`` fields whose value selects this family when
            ``--pipeline-schedule`` is not given (interleaved 1F1B:
            ``num_layers_per_virtual_pipeline_stage``); the same field with another
            ``--pipeline-schedule`` is refused as a conflict.
        derive_config: ``derive_config(parallel_config, num_layers)`` -> ``{field: value}`` of the
            derived ``config.parallel`` fields; raises ValueError naming the flags for a config
            the family cannot run (validation calls it; default :func:`even_stage_config`).
        critical_path: ``critical_path(pipeline_size, num_microbatches, **options)`` -> (Cf, Cb),
            the forwards and backwards of one model stage on the critical path (the performance
            model's closed form T = (F + Cp2p) Cf + (Bk + Cp2p) Cb + exposed all-reduce), or None
            where no closed form is known (then only the simulated plan is used).
        model_variants: ``(scheme suffix, options)`` pairs the performance model compares as
            schemes ``name`` + suffix (default: the family with its default options).
        config_flags: ``config_flags(family, options, num_layers, pipeline_size)`` -> the
            ``pretrain_gpt.py`` flags that select ``options`` (the inverse of ``derive_config``;
            default :func:`option_flags`, each option's config field as a flag).
    """

    name: str
    description: str
    build: Callable[..., list[list[Instruction]]]
    layout: Callable[..., ScheduleLayout]
    options: tuple[ScheduleOption, ...] = ()
    check: Callable[..., None] = _no_check
    op_label: Callable[[Instruction, dict], str] = _no_label
    checkpoint_options: tuple[str, ...] = ()
    memory_note: Callable[[dict], Optional[str]] = lambda options: None
    selected_by: tuple[str, ...] = ()
    derive_config: Callable[[Any, int], dict] = even_stage_config
    critical_path: Callable[..., Optional[tuple[int, int]]] = one_op_per_slot
    model_variants: tuple[tuple[str, dict], ...] = (("", {}),)
    config_flags: Callable[..., list[str]] = option_flags

    def option(self, name: str) -> ScheduleOption:
        for option in self.options:
            if option.name == name:
                return option
        raise KeyError(name)

    def defaults(self) -> dict:
        return {option.name: option.default for option in self.options}

    def options_from_config(self, parallel_config) -> dict:
        """The builder options ``config.parallel`` selects (None values dropped)."""
        values = {option.name: getattr(parallel_config, option.config_field, None)
                  for option in self.options}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, eq=False)
class ScheduleRegistry:
    """An immutable, ordered collection of schedule families (compared and hashed by identity,
    so caches can key on it)."""

    families: tuple[ScheduleFamily, ...] = field(default_factory=tuple)
    default: Optional[str] = None  # the family used when no flag selects one (None: the first)

    def __post_init__(self) -> None:
        names = [family.name for family in self.families]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"schedule families registered twice: {', '.join(duplicates)}")
        if self.default is not None and self.default not in names:
            raise ValueError(f"default schedule {self.default!r} is not registered; allowed: "
                             f"{', '.join(names)}")

    @property
    def default_name(self) -> str:
        return self.default if self.default is not None else self.families[0].name

    @property
    def choices(self) -> tuple[str, ...]:
        """The ``--pipeline-schedule`` choices: the default first, then registration order."""
        return (self.default_name,) + tuple(name for name in self.names
                                            if name != self.default_name)

    def select(self, parallel_config) -> str:
        """The family ``config.parallel`` selects: ``--pipeline-schedule``, else the family whose
        ``selected_by`` flag is given, else the default. Raises ValueError for a conflict."""
        chosen = parallel_config.pipeline_schedule
        for family in self.families:
            for field_name in family.selected_by:
                if getattr(parallel_config, field_name, None) is None:
                    continue
                if chosen not in (None, family.name):
                    raise ValueError(
                        f"--{field_name.replace('_', '-')} selects the {family.name} schedule "
                        f"and conflicts with --pipeline-schedule {chosen}; drop one")
                chosen = family.name
        return chosen if chosen is not None else self.default_name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(family.name for family in self.families)

    def with_family(self, family: ScheduleFamily) -> "ScheduleRegistry":
        """A new registry with ``family`` added (this one is unchanged)."""
        return ScheduleRegistry(self.families + (family,), self.default)

    def family(self, name: str) -> ScheduleFamily:
        for family in self.families:
            if family.name == name:
                return family
        raise ValueError(f"unknown pipeline schedule {name!r}; allowed: {', '.join(self.names)}")

    def option_names(self) -> list[str]:
        return sorted({option.name for family in self.families for option in family.options})

    def tool_options(self) -> list[ScheduleOption]:
        """Every family's options, one per flag, in registration order (for tools' parsers)."""
        seen, result = set(), []
        for family in self.families:
            for option in family.options:
                if option.flag not in seen:
                    seen.add(option.flag)
                    result.append(option)
        return result
