"""The two kinds of Megatron-LM flag that are not config fields, and shorthands to declare them.

:class:`CompatibilityFlag`: accepted with Megatron's value syntax and logged once as ignored, with
the reason. :class:`UnimplementedFlag`: accepted by the parser only to be rejected with its reason,
together with every other problem of the command line. The tables of both are in
:mod:`megatron.training.megatron_flags` and :mod:`megatron.training.megatron_flags_recent`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _dest(prefix: str, flag: str) -> str:
    return prefix + flag.lstrip("-").replace("-", "_").lower()


@dataclass(frozen=True)
class CompatibilityFlag:
    """A Megatron flag that is not part of our config: accepted so scripts keep working, then
    reported as ignored in the log (never silently).

    Its value syntax is Megatron's: a switch by default, one value from ``choices``, one free value
    (``takes_value``) or one or more values (``takes_list``, Megatron's ``nargs='+'``).
    """

    flag: str
    reason: str
    choices: Optional[tuple[str, ...]] = None  # takes one value from these when set
    takes_value: bool = False                  # takes one free value (e.g. an interval)
    takes_list: bool = False                   # takes one or more free values

    def __post_init__(self):
        assert (self.choices is not None) + self.takes_value + self.takes_list <= 1, \
            f"{self.flag}: choose one value syntax"

    @property
    def dest(self) -> str:
        return _dest("compat__", self.flag)

    @property
    def shown(self) -> str:
        """The flag with its value syntax, as docs/flags.md shows it."""
        if self.choices:
            return f"{self.flag} {{{','.join(self.choices)}}}"
        if self.takes_list:
            return f"{self.flag} VALUE [VALUE ...]"
        return f"{self.flag} VALUE" if self.takes_value else self.flag


@dataclass(frozen=True)
class UnimplementedFlag:
    """A Megatron flag for a feature that does not exist here (rejected with the reason).

    The parser takes any number of values after it (Megatron's switches, single values and lists
    alike), so the rest of the command line still parses and is reported in the same message.
    """

    flag: str
    reason: str

    @property
    def dest(self) -> str:
        return _dest("unimplemented__", self.flag)


def switches(reason: str, *flags: str) -> tuple[CompatibilityFlag, ...]:
    """Compatibility flags that take no value, all ignored for the same reason."""
    return tuple(CompatibilityFlag(flag, reason) for flag in flags)


def with_value(reason: str, *flags: str) -> tuple[CompatibilityFlag, ...]:
    """Compatibility flags that take one free value, all ignored for the same reason."""
    return tuple(CompatibilityFlag(flag, reason, takes_value=True) for flag in flags)


def rejected(reason: str, *flags: str) -> tuple[UnimplementedFlag, ...]:
    """Unimplemented flags (any value syntax), all rejected for the same reason."""
    return tuple(UnimplementedFlag(flag, reason) for flag in flags)
