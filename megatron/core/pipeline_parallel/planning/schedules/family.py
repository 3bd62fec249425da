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
    """

    name: str
    default: Any
    config_field: str
    flag: str
    type: Callable = str
    choices: Optional[tuple] = None
    help: str = ""
    tool_default: Any = None

    @property
    def default_for_tools(self) -> Any:
        return self.default if self.tool_default is None else self.tool_default


def _no_check(pipeline_size: int, num_microbatches: int, **options) -> None:
    """Families without constraints beyond positive D and N accept everything."""


def _no_label(op: Instruction, options: dict) -> str:
    return ""


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


@dataclass(frozen=True)
class ScheduleRegistry:
    """An immutable, ordered collection of schedule families."""

    families: tuple[ScheduleFamily, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [family.name for family in self.families]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"schedule families registered twice: {', '.join(duplicates)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(family.name for family in self.families)

    def with_family(self, family: ScheduleFamily) -> "ScheduleRegistry":
        """A new registry with ``family`` added (this one is unchanged)."""
        return ScheduleRegistry(self.families + (family,))

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
