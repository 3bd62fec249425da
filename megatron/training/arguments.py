"""Megatron's command-line flags, generated from the typed config in :mod:`megatron.core.config`.

Owns the thin skin between a Megatron launch script and :class:`MegatronConfig`:

- :func:`build_parser`: one ``--flag`` per config field (``num_layers`` -> ``--num-layers``), help text,
  choices and aliases from the field metadata, one ``--help`` group per config section. Fields marked
  ``derived`` never become flags.
- :func:`parse_args`: parse (``--pipeline-schedule``'s choices are the families of the schedule
  registry passed, default ``BUILTIN_SCHEDULES``), log the flags that are accepted for
  compatibility but ignored (the
  tables are in :mod:`megatron.training.megatron_flags`), validate
  (:func:`megatron.training.config_validation.validate_config`), and report every problem at once:
  unknown flags, known-but-unimplemented ones and invalid combinations in one message.
- :func:`config_to_argv`: the inverse, so ``parse_args(config_to_argv(c), world_size) == c``.
- :func:`format_arguments`: Megatron's ``---- arguments ----`` block.
- :func:`accepted_flags` and :func:`flags_markdown`: the flag set for the golden test and docs/flags.md.

Nothing here reads ``sys.argv`` unless ``parse_args`` is called without ``argv``.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import logging
import sys
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, TextIO

from megatron.core.config import MegatronConfig
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleRegistry
from megatron.training.config_validation import (DEFAULT_MOCK_VOCAB_SIZE, NOT_SUPPORTED_YET,
                                                 ConfigurationError, pad_vocab_size,
                                                 set_padded_vocab_size, validate_config)
from megatron.training.megatron_flags import (COMPATIBILITY_FLAGS, MEGATRON_COMMIT,
                                              UNIMPLEMENTED_FLAGS, CompatibilityFlag,
                                              RENAMED_FLAGS, invalid_choice_problem,
                                              renamed_flag)
from megatron.training.launch_env import world_size_from_environment

logger = logging.getLogger(__name__)

__all__ = [
    "COMPATIBILITY_FLAGS", "IGNORED_FIELDS", "UNIMPLEMENTED_FLAGS", "CompatibilityFlag",
    "accepted_flags", "build_parser",
    "config_to_argv", "flags_markdown", "format_arguments", "pad_vocab_size", "parse_args",
    "parse_args_unvalidated", "print_arguments", "set_padded_vocab_size", "validate_config",
]

DOCS_HINT = "see docs/flags.md for the supported flags"


# Config fields that are accepted, but whose feature is not implemented and is harmless to skip
# (performance or bookkeeping only). Logged as ignored when set to a non-default value.
IGNORED_FIELDS: dict[str, str] = {
    "num_workers": "samples are read in the training process from memory-mapped files "
                   "(no data-loader workers)",
}


# The config field whose choices are the schedule registry's families (section, field).
SCHEDULE_FIELD = ("parallel", "pipeline_schedule")


def _flag_for(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class _ConfigField:
    """One flag-carrying (or derived) config field with its resolved annotation."""

    section: str
    field: dataclasses.Field
    value_type: type          # int, float, str, bool or list
    element_type: type        # for lists: the element type; else == value_type
    optional: bool

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return _flag_for(self.field.name)

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.field.name}"

    @property
    def derived(self) -> bool:
        return bool(self.field.metadata.get("derived"))

    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default


def _resolve_annotation(annotation: Any) -> tuple[type, type, bool]:
    """``Optional[list[str]]`` -> (list, str, True); ``int`` -> (int, int, False)."""
    optional = False
    if typing.get_origin(annotation) is typing.Union:
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        assert len(members) == 1, f"unsupported union annotation {annotation}"
        annotation, optional = members[0], True
    if annotation is list or typing.get_origin(annotation) is list:
        element_args = typing.get_args(annotation)
        return list, (element_args[0] if element_args else str), optional
    assert annotation in (int, float, str, bool), f"unsupported config annotation {annotation}"
    return annotation, annotation, optional


def _section_class(section_field: dataclasses.Field, model_section: Optional[type]) -> type:
    """A section's dataclass; ``config.model``'s is the model's own (a ModelSpec's
    ``config_section``; default GPT's :class:`ModelConfig`)."""
    if section_field.name == "model" and model_section is not None:
        return model_section
    return section_field.default_factory


def config_fields(model_section: Optional[type] = None) -> Iterator[_ConfigField]:
    """Every field of every config section, in declaration order (derived fields included)."""
    for section_field in dataclasses.fields(MegatronConfig):
        section_class = _section_class(section_field, model_section)
        hints = typing.get_type_hints(section_class)
        for config_field in dataclasses.fields(section_class):
            value_type, element_type, optional = _resolve_annotation(hints[config_field.name])
            yield _ConfigField(section_field.name, config_field, value_type, element_type,
                               optional)


def field_choices(spec: _ConfigField, registry: ScheduleRegistry = BUILTIN_SCHEDULES):
    """The allowed values of ``spec``'s flag: the registry's family names for
    ``--pipeline-schedule``, the field's own ``choices`` otherwise (None: any value)."""
    if (spec.section, spec.name) == SCHEDULE_FIELD:
        return registry.choices
    return spec.field.metadata.get("choices")


def _help_text(spec: _ConfigField) -> str:
    text = spec.field.metadata.get("help", "")
    default = spec.default()
    if spec.value_type is not bool and default is not None:
        text += f" (default: {default})"
    return text.replace("%", "%%")  # argparse formats help strings with %


class _MegatronArgumentParser(argparse.ArgumentParser):
    """Collects unknown flags instead of stopping at the first, so that one message can name
    every problem of a command line (see :func:`parse_args`)."""

    def parse_args(self, args=None, namespace=None):
        namespace, unknown = self.parse_known_args(args, namespace)
        problems = self.unknown_flag_problems(unknown)
        if problems:
            self.error(problems_message(problems))
        return namespace

    def unknown_flag_problems(self, unknown: list[str]) -> list[str]:
        """One line per unknown flag; "did you mean" only for a true rename (never a look-alike,
        which could name a flag of another meaning)."""
        flags = [item.split("=", 1)[0] for item in unknown if item.startswith("-")]
        if unknown and not flags:
            return [f"unexpected argument(s) {' '.join(unknown)}: every value must follow its "
                    f"flag"]
        known = {option for action in self._actions for option in action.option_strings}
        problems = []
        for flag in flags:
            renamed = renamed_flag(flag, known)
            hint = f" (did you mean {renamed}? it is the same flag's spelling)" if renamed else ""
            problems.append(f"unknown flag {flag}{hint}: neither Megatron-LM (up to "
                            f"{MEGATRON_COMMIT[:7]}) nor Megatron-Chimera has it")
        return problems


def problems_message(problems: Sequence[str]) -> str:
    """All problems of one command line in one message."""
    if len(problems) == 1:
        return f"unsupported by Megatron-Chimera: {problems[0]} ({DOCS_HINT})"
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return f"unsupported by Megatron-Chimera, {len(problems)} problems:\n{lines}\n({DOCS_HINT})"


def _choices_metavar(choices) -> str:
    return "{" + ",".join(str(choice) for choice in choices) + "}"


def _invalid_choices(given: dict, registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                     model_section: Optional[type] = None) -> list[str]:
    """Problems for values outside a flag's choices; such values are removed from ``given`` (the
    field keeps its default, so the remaining flags can still be validated)."""
    checked = [(spec.flag, spec.dest, field_choices(spec, registry))
               for spec in config_fields(model_section)]
    checked += [(flag.flag, flag.dest, flag.choices) for flag in COMPATIBILITY_FLAGS]
    problems = []
    for flag, dest, choices in checked:
        if choices and dest in given and given[dest] is not None and \
                given[dest] not in choices:
            problems.append(invalid_choice_problem(flag, given.pop(dest), choices))
    return problems


def _add_compatibility_flags(parser: argparse.ArgumentParser) -> None:
    compat = parser.add_argument_group(
        "accepted for compatibility, ignored",
        "Megatron flags that change nothing here; each one is reported in the log when given.")
    for flag in COMPATIBILITY_FLAGS:
        help_text = f"Ignored: {flag.reason}."
        if flag.choices:
            compat.add_argument(flag.flag, dest=flag.dest, metavar=_choices_metavar(flag.choices),
                                default=argparse.SUPPRESS, help=help_text)
        elif flag.takes_value or flag.takes_list:
            compat.add_argument(flag.flag, dest=flag.dest, default=argparse.SUPPRESS,
                                nargs="+" if flag.takes_list else None, metavar="VALUE",
                                help=help_text)
        else:
            compat.add_argument(flag.flag, dest=flag.dest, action="store_true",
                                default=argparse.SUPPRESS, help=help_text)
    unimplemented = parser.add_argument_group(
        "known Megatron flags, not implemented (rejected)",
        "Accepted by the parser only so that every problem is reported at once.")
    for flag in UNIMPLEMENTED_FLAGS:
        unimplemented.add_argument(flag.flag, dest=flag.dest, nargs="*", metavar="VALUE",
                                   default=argparse.SUPPRESS,
                                   help=f"Not implemented: {flag.reason}.")


def build_parser(registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                 model_section: Optional[type] = None) -> argparse.ArgumentParser:
    """The argparse parser generated from the config dataclasses (plus the compatibility flags);
    ``--pipeline-schedule`` lists the families of ``registry``; ``model_section``: the model's
    flags (default GPT's)."""
    parser = _MegatronArgumentParser(
        prog="pretrain_gpt.py", allow_abbrev=False,
        # A short usage line keeps error messages readable; --help lists every flag.
        usage="%(prog)s [flags] (see --help or docs/flags.md)",
        description="Megatron-Chimera: Megatron-LM-style GPT training with Chimera pipelines. "
                    f"Flags are Megatron's names; {DOCS_HINT}. To train a Megatron launch "
                    "script with Chimera, add --pipeline-schedule chimera (an even "
                    "--pipeline-model-parallel-size; the --chimera-* flags of the parallel "
                    "section choose its variant); the losses equal 1f1b's up to rounding. Megatron "
                    "flags that change nothing here are accepted and reported in the log; flags "
                    "of features not implemented here (mixture of experts, FP8, context "
                    "parallelism, ...) are listed in the last section and refused with a "
                    "message naming them.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in config_fields(model_section):
        if spec.derived:
            continue
        if spec.section not in groups:
            section_class = _section_class(
                next(f for f in dataclasses.fields(MegatronConfig) if f.name == spec.section),
                model_section)
            groups[spec.section] = parser.add_argument_group(
                spec.section, (section_class.__doc__ or "").strip())
        names = [spec.flag, *spec.field.metadata.get("aliases", ())]
        common = dict(dest=spec.dest, default=argparse.SUPPRESS, help=_help_text(spec))
        if spec.value_type is bool:
            assert spec.default() is False, f"bool field {spec.name} must default to False"
            groups[spec.section].add_argument(*names, action="store_true", **common)
            continue
        choices = field_choices(spec, registry)
        if spec.value_type is list:
            groups[spec.section].add_argument(*names, nargs="+", type=spec.element_type,
                                              metavar=spec.name.upper(), **common)
        else:
            # Choices are checked after parsing (parse_command_line), so that a value outside
            # them is reported together with every other problem instead of stopping argparse.
            groups[spec.section].add_argument(*names, type=spec.value_type,
                                              metavar=_choices_metavar(choices) if choices
                                              else spec.name.upper(), **common)
    _add_compatibility_flags(parser)
    return parser


def _ignored_messages(namespace: argparse.Namespace, config: MegatronConfig) -> list[str]:
    given = vars(namespace)
    messages = [f"{flag.flag} is accepted for compatibility and ignored by Megatron-Chimera: "
                f"{flag.reason}" for flag in COMPATIBILITY_FLAGS if flag.dest in given]
    for spec in config_fields(type(config.model)):
        if spec.name in IGNORED_FIELDS and \
                getattr(getattr(config, spec.section), spec.name) != spec.default():
            messages.append(f"{spec.flag} is accepted for compatibility and ignored by "
                            f"Megatron-Chimera: {IGNORED_FIELDS[spec.name]}")
    return messages


@dataclass
class ParsedCommandLine:
    """A parsed command line before validation: the config from the known flags, the "ignored"
    messages of the compatibility flags given, and the problems found while parsing (unknown flags
    and known-but-unimplemented ones)."""

    config: MegatronConfig
    ignored: list[str]
    problems: list[str]


@functools.lru_cache(maxsize=8)
def _shared_parser(registry: ScheduleRegistry, model_section: Optional[type]
                   ) -> argparse.ArgumentParser:
    """:func:`build_parser`, built once per (registry, model section): building it adds about a
    thousand arguments, and parsing never changes a parser (the values land in a new namespace)."""
    return build_parser(registry, model_section)


def parse_command_line(argv: Optional[Sequence[str]] = None,
                       registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                       model_section: Optional[type] = None) -> ParsedCommandLine:
    """Parse without stopping at problems: every unknown or unimplemented flag is collected."""
    parser = _shared_parser(registry, model_section)
    namespace, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    given = vars(namespace)
    problems = [f"{flag.flag} is not implemented: {flag.reason}"
                for flag in UNIMPLEMENTED_FLAGS if flag.dest in given]
    problems += parser.unknown_flag_problems(unknown)
    problems += _invalid_choices(given, registry, model_section)
    section_values: dict[str, dict[str, Any]] = {}
    for spec in config_fields(model_section):
        if spec.dest in given:
            section_values.setdefault(spec.section, {})[spec.name] = given[spec.dest]
    sections = {section_field.name: _section_class(section_field, model_section)(
                    **section_values.get(section_field.name, {}))
                for section_field in dataclasses.fields(MegatronConfig)}
    config = MegatronConfig(**sections)
    return ParsedCommandLine(config, _ignored_messages(namespace, config), problems)


def parse_args_unvalidated(argv: Optional[Sequence[str]] = None,
                           registry: ScheduleRegistry = BUILTIN_SCHEDULES
                           ) -> tuple[MegatronConfig, list[str]]:
    """Parse flags into a config without validation or derived fields.

    Returns the config and the "ignored" messages for the compatibility flags given. Unknown and
    unimplemented flags exit through argparse (status 2) with one message naming all of them.
    """
    parsed = parse_command_line(argv, registry)
    if parsed.problems:
        build_parser(registry).error(problems_message(parsed.problems))
    return parsed.config, parsed.ignored


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
               registry: ScheduleRegistry = BUILTIN_SCHEDULES, *,
               model_spec=None) -> MegatronConfig:
    """Parse Megatron flags into a validated :class:`MegatronConfig` with derived fields filled.

    ``argv`` defaults to ``sys.argv[1:]``; ``world_size`` to the launcher's (``WORLD_SIZE`` from
    torchrun, else ``SLURM_NTASKS``, else 1); ``registry`` holds the schedule families
    ``--pipeline-schedule`` may name (pass ``BUILTIN_SCHEDULES.with_family(...)`` for a family of
    your own; the same registry goes to ``pretrain``). Accepted-but-ignored flags are logged once
    each as warnings on the ``megatron.training.arguments`` logger. Every problem is reported at once:
    when any flag is unknown or not implemented, argparse exits with status 2 and one message
    listing those together with the validation problems of the other flags; otherwise invalid
    combinations raise :class:`ConfigurationError` (a ``ValueError``) listing all of them.
    ``model_spec`` (a :class:`~megatron.training.model_spec.ModelSpec`; default GPT) supplies the
    model's flags (``config_section``) and checks (``validation_steps``).
    """
    model_section = model_spec.config_section if model_spec is not None else None
    parsed = parse_command_line(argv, registry, model_section)
    for message in parsed.ignored:
        logger.warning(message)
    if world_size is None:
        world_size = world_size_from_environment()
    try:
        config = validate_config(parsed.config, world_size, registry, model_steps=(
            model_spec.validation_steps if model_spec is not None else None))
    except ConfigurationError as error:
        if not parsed.problems:
            raise
        parsed.problems.extend(error.problems)
    if parsed.problems:
        build_parser(registry).error(problems_message(parsed.problems))
    return config


def _value_tokens(value: Any) -> list[str]:
    if isinstance(value, list):
        return [_value_tokens(item)[0] for item in value]
    if isinstance(value, float):
        return [repr(value)]  # repr round-trips exactly
    return [str(value)]


def config_to_argv(config: MegatronConfig) -> list[str]:
    """Flags that reproduce ``config``: every non-derived field that differs from its default.

    ``parse_args(config_to_argv(c), world_size=c.parallel.world_size) == c`` for any ``c`` returned
    by :func:`parse_args` (a padded vocabulary filled later from a tokenizer is derived, not a flag).
    """
    argv: list[str] = []
    for spec in config_fields(type(config.model)):
        if spec.derived:
            continue
        value = getattr(getattr(config, spec.section), spec.name)
        if value == spec.default() or value is None:
            continue
        if spec.name == "global_batch_size" and config.training.batch_size_steps:
            continue  # derived from the step schedule (the two flags exclude each other)
        if spec.value_type is bool:
            argv.append(spec.flag)
        else:
            argv.extend([spec.flag, *_value_tokens(value)])
    return argv


def format_arguments(config: MegatronConfig) -> str:
    """Megatron's arguments block: every field (derived ones too), sorted by name, dot-padded."""
    values = {spec.name: getattr(getattr(config, spec.section), spec.name)
              for spec in config_fields(type(config.model))}
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(values, key=str.lower):
        lines.append(f"  {name} {'.' * (48 - len(name))} {values[name]}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def print_arguments(config: MegatronConfig, file: Optional[TextIO] = None) -> None:
    """Print :func:`format_arguments` (call it on one rank only)."""
    print(format_arguments(config), file=file or sys.stdout, flush=True)


def accepted_flags() -> list[str]:
    """Every option string the parser accepts (aliases and compatibility flags included, the
    known-but-unimplemented flags, which are always rejected, excluded), sorted."""
    return sorted(option for action in build_parser()._actions for option in action.option_strings
                  if not action.dest.startswith("unimplemented__"))


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flags_markdown() -> str:
    """The generated tables of docs/flags.md: flags per section, ignored and rejected ones."""
    not_supported = {feature.field: feature.shown for feature in NOT_SUPPORTED_YET}
    lines: list[str] = []
    current_section = None
    for spec in config_fields():
        if spec.derived:
            continue
        if spec.section != current_section:
            current_section = spec.section
            lines += ["", f"### {spec.section}", "", "| flag | default | meaning |",
                      "|---|---|---|"]
        flags = ", ".join(f"`{name}`" for name in [spec.flag,
                                                   *spec.field.metadata.get("aliases", ())])
        choices = field_choices(spec)
        meaning = spec.field.metadata.get("help", "")
        if choices:
            meaning += " Choices: " + ", ".join(f"`{choice}`" for choice in choices) + "."
        if spec.name in IGNORED_FIELDS:
            meaning += f" **Accepted, ignored (logged):** {IGNORED_FIELDS[spec.name]}."
        if spec.name in not_supported:
            meaning += f" **Rejected (not supported yet): `{not_supported[spec.name]}`.**"
        default = spec.default()
        shown_default = "off" if spec.value_type is bool else (
            "-" if default is None else f"`{default}`")
        lines.append(f"| {flags} | {shown_default} | {_markdown_cell(meaning)} |")
    lines += ["", "### accepted for compatibility, ignored (logged)", "",
              "| flag | why it changes nothing |", "|---|---|"]
    for flag in COMPATIBILITY_FLAGS:
        lines.append(f"| `{flag.shown}` | {_markdown_cell(flag.reason)} |")
    lines += ["", "### rejected: not supported yet", "", "| flag (value) | what to do instead |",
              "|---|---|"]
    for feature in NOT_SUPPORTED_YET:
        lines.append(f"| `{feature.shown}` | {_markdown_cell(feature.instead)} |")
    lines += ["", "### rejected: Megatron flags for features that do not exist here", "",
              "| flag | why |", "|---|---|"]
    for unimplemented in UNIMPLEMENTED_FLAGS:
        lines.append(f"| `{unimplemented.flag}` | {_markdown_cell(unimplemented.reason)} |")
    lines += ["", "### earlier spellings (Megatron-LM's history), classified like today's flag", "",
              "| earlier spelling | today's flag |", "|---|---|"]
    for old, new in RENAMED_FLAGS.items():
        lines.append(f"| `{old}` | `{new}` |")
    lines += ["", f"Mock-data vocabulary without a tokenizer: `--vocab-size`, default "
                  f"{DEFAULT_MOCK_VOCAB_SIZE}.", ""]
    return "\n".join(lines)
