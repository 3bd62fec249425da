"""Tier 0: every flag of Megatron-LM's argument list is classified here: a config field, accepted
for compatibility (parsed, logged once as ignored) or known but not implemented (rejected with its
reason); none of them is an "unknown flag".

The lists are tests/golden/megatron_flags_d98e8a6.txt (every option string of Megatron-LM's parser
at d98e8a6, August 2026, with its value syntax) and tests/golden/megatron_flags_removed.txt (the
spellings Megatron-LM's history accepted and it has since dropped). The first is written by
tools/megatron_lm/dump_flags.py.
"""

import logging
from pathlib import Path

import pytest

from megatron.training.arguments import (accepted_flags, build_parser, config_fields, parse_args,
                                         parse_command_line)
from megatron.training.megatron_flags import (COMPATIBILITY_FLAGS, MEGATRON_COMMIT, RENAMED_FLAGS,
                                              UNIMPLEMENTED_FLAGS, VALUES_NOT_IMPLEMENTED)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _read_flags(name: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """flag -> (switch | value | list, Megatron's choices) from a golden list."""
    flags = {}
    for line in (GOLDEN / name).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        flag, kind, *choices = line.split()
        assert flag not in flags, f"{flag} listed twice in {name}"
        flags[flag] = (kind, tuple(choices[0].split(",")) if choices else ())
    return flags


MEGATRON_FLAGS = _read_flags(f"megatron_flags_{MEGATRON_COMMIT[:7]}.txt")
REMOVED_FLAGS = [line for line in (GOLDEN / "megatron_flags_removed.txt").read_text().splitlines()
                 if line.strip() and not line.startswith("#")]

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 --mock-data").split()

COMPATIBILITY = {flag.flag: flag for flag in COMPATIBILITY_FLAGS}
UNIMPLEMENTED = {flag.flag: flag for flag in UNIMPLEMENTED_FLAGS}


def plausible_values(flag: str) -> list[str]:
    """Values in the syntax the flag takes (none for a switch)."""
    spec = COMPATIBILITY.get(flag)
    if spec is not None:
        if spec.choices:
            return [spec.choices[-1]]
        return ["1", "2"] if spec.takes_list else ["2"] if spec.takes_value else []
    kind = MEGATRON_FLAGS.get(flag, ("value", ()))[0]
    return {"switch": [], "value": ["2"], "list": ["1", "2"]}[kind]


def test_the_megatron_lists_are_complete_and_distinct():
    assert len(MEGATRON_FLAGS) == 876
    assert len(set(REMOVED_FLAGS)) == len(REMOVED_FLAGS) == 124
    assert not set(REMOVED_FLAGS) & set(MEGATRON_FLAGS)
    # The 2021-22 recompute spellings the scripts of that time use are among the removed ones.
    assert {"--activations-checkpoint-method", "--checkpoint-num-layers",
            "--distribute-checkpointed-activations"} <= set(REMOVED_FLAGS)


@pytest.mark.parametrize("flags", [list(MEGATRON_FLAGS), REMOVED_FLAGS],
                         ids=["d98e8a6", "removed-spellings"])
def test_every_megatron_flag_is_accepted_or_known_unimplemented(flags):
    accepted = set(accepted_flags())
    unclassified = [flag for flag in flags if flag not in accepted and flag not in UNIMPLEMENTED]
    assert not unclassified, f"Megatron flags that would be 'unknown flag': {unclassified}"
    assert not accepted & set(UNIMPLEMENTED), "a flag is both accepted and rejected"
    assert len(COMPATIBILITY) == len(COMPATIBILITY_FLAGS), "a compatibility flag is listed twice"
    assert len(UNIMPLEMENTED) == len(UNIMPLEMENTED_FLAGS), "an unimplemented flag is listed twice"


def test_compatibility_flags_take_values_as_megatron_declares_them():
    for flag, spec in COMPATIBILITY.items():
        if flag not in MEGATRON_FLAGS:
            continue  # a removed spelling: its syntax is the one of its time
        kind, choices = MEGATRON_FLAGS[flag]
        ours = "list" if spec.takes_list else "value" if (
            spec.choices is not None or spec.takes_value) else "switch"
        assert ours == kind, flag
        if spec.choices and choices:
            assert set(spec.choices) <= set(choices), flag
            assert set(choices) - set(spec.choices) <= set(VALUES_NOT_IMPLEMENTED.get(flag, {})), \
                f"{flag}: a Megatron value is neither accepted nor reported as not implemented"


def test_every_megatron_value_of_a_config_field_is_accepted_or_not_implemented():
    for spec in config_fields():
        if spec.derived or spec.flag not in MEGATRON_FLAGS:
            continue
        kind, choices = MEGATRON_FLAGS[spec.flag]
        ours = spec.field.metadata.get("choices") or ()
        if choices and ours:
            missing = set(choices) - {str(c) for c in ours} - set(
                VALUES_NOT_IMPLEMENTED.get(spec.flag, {}))
            assert not missing, f"{spec.flag}: Megatron values unclassified: {missing}"
        expected = "switch" if spec.value_type is bool else (
            "list" if spec.value_type is list else "value")
        assert kind == expected, spec.flag


@pytest.mark.parametrize("flag", list(COMPATIBILITY))
def test_compatibility_flag_parses_with_megatrons_value_syntax(flag):
    parsed = parse_command_line(TINY + [flag] + plausible_values(flag))
    assert parsed.problems == []
    assert len(parsed.ignored) == 1 and parsed.ignored[0].startswith(flag + " is accepted")


def test_every_compatibility_flag_is_logged_once_as_ignored(caplog):
    argv = list(TINY)
    for flag in COMPATIBILITY_FLAGS:
        argv += [flag.flag] + plausible_values(flag.flag)
    with caplog.at_level(logging.WARNING, logger="megatron.training.arguments"):
        parse_args(argv, world_size=1)
    ignored = [record.getMessage() for record in caplog.records
               if "accepted for compatibility and ignored" in record.getMessage()]
    assert [message.split()[0] for message in ignored] == list(COMPATIBILITY)
    for message in ignored:
        assert message.endswith(COMPATIBILITY[message.split()[0]].reason)


@pytest.mark.parametrize("flag", list(UNIMPLEMENTED))
def test_unimplemented_flag_is_rejected_with_its_reason(flag):
    parsed = parse_command_line(TINY + [flag] + plausible_values(flag))
    assert parsed.problems == [f"{flag} is not implemented: {UNIMPLEMENTED[flag].reason}"]


def test_every_unimplemented_flag_is_reported_in_one_message(capsys):
    argv = list(TINY)
    for flag in UNIMPLEMENTED:
        argv += [flag] + plausible_values(flag)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size=1)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert f"{len(UNIMPLEMENTED)} problems:" in message
    assert "unknown flag" not in message
    for flag in UNIMPLEMENTED:
        assert f"  - {flag} is not implemented: " in message, flag


def _classification(flag: str):
    """("field", dest) for a config flag, ("ignored", reason), ("rejected", reason) or None."""
    for action in build_parser()._actions:
        if flag in action.option_strings:
            if action.dest.startswith("compat__"):
                return ("ignored", COMPATIBILITY[action.option_strings[0]].reason)
            if action.dest.startswith("unimplemented__"):
                return ("rejected", None)
            return ("field", action.dest)
    return None


@pytest.mark.parametrize("old, new", sorted(RENAMED_FLAGS.items()))
def test_an_earlier_spelling_is_classified_like_todays_flag(old, new):
    old_kind, new_kind = _classification(old), _classification(new)
    assert old_kind is not None and new_kind is not None, (old, new)
    assert old_kind[0] == new_kind[0], (old_kind, new_kind)
    if old_kind[0] == "field" and old != "--activations-checkpoint-method":
        assert old_kind == new_kind  # the same config field


@pytest.mark.parametrize("old, new, value", [
    ("--batch-size", "--micro-batch-size", "2"),
    ("--model-parallel-size", "--tensor-model-parallel-size", "2"),
    ("--warmup", "--lr-warmup-fraction", "0.1"),
    ("--min-scale", "--min-loss-scale", "2"),
    ("--persistent-save-interval", "--save-interval", "3"),
])
def test_an_earlier_spelling_means_todays_flag(old, new, value):
    base = TINY + ["--fp16", "--save", "ckpt"]
    assert parse_args(base + [old, value], world_size=2) == \
        parse_args(base + [new, value], world_size=2)


def test_the_2021_recompute_spellings_select_full_recomputation():
    config = parse_args(TINY + ["--activations-checkpoint-method", "block",
                                "--activations-checkpoint-num-layers", "1",
                                "--distribute-checkpointed-activations"], world_size=1)
    assert (config.recompute.recompute_granularity, config.recompute.recompute_method,
            config.recompute.recompute_num_layers) == ("full", "block", 1)
    config = parse_args(TINY + ["--checkpoint-activations", "--checkpoint-num-layers", "2"],
                        world_size=1)
    assert (config.recompute.recompute_granularity, config.recompute.recompute_method,
            config.recompute.recompute_num_layers) == ("full", "uniform", 2)


@pytest.mark.parametrize("flag", [
    # Look-alikes of flags of another meaning: never suggested.
    "--no-ckpt-fully-parallel-saves", "--moe-ffn-hidden-sizes", "--q-lora-ranks", "--num-layer",
    "--mtp-num-layer", "--ffn-hiden-size", "--lr-decay-iter"])
def test_an_unknown_flag_gets_no_look_alike_suggestion(flag):
    problems = parse_command_line(TINY + [flag, "1"]).problems
    assert len(problems) == 1
    assert problems[0].startswith(f"unknown flag {flag}: ")
    assert "did you mean" not in problems[0]


def test_an_unknown_flag_points_to_the_flag_list(capsys):
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--no-such-flag"], world_size=1)
    error = capsys.readouterr().err
    assert "unknown flag --no-such-flag" in error and "docs/flags.md" in error
    assert "remove it" not in error


def test_underscores_for_dashes_are_the_same_flag():
    problems = parse_command_line(TINY + ["--num_layers", "2"]).problems
    assert problems == [problems[0]] and "did you mean --num-layers?" in problems[0]
