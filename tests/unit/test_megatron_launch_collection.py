"""Tier 0: a collection of real Megatron-LM GPT launch configurations parses and validates, unchanged
but for data and output paths, wherever it asks only for features this project has.

tests/data/megatron_gpt_launch_configs.jsonl holds, one JSON object a line (name, source commit and
path, world size, argv): the MODEL_ARGS of every pretraining GPT functional test of Megatron-LM at
d98e8a6 (August 2026) and at 3efa8c2 (October 2024), every version of its canonical GPT example
scripts, its current GPT example scripts and the SC21 (PTD-P paper) scripts with every option
combination expanded. The world size is the script's own (nodes x GPUs) where it has one, else
the smallest of 8, 16, 32, ... GPUs that fits its TP x PP and batch sizes. The file is written by
tools/megatron_lm/build_launch_configs.py from a Megatron-LM git directory.

A configuration "asks for a feature we lack" when a problem reported for it says "not
implemented" or "not supported yet" (mixture of experts, rotary embeddings, sequence parallelism
with TP > 1, FP8, ...); every other configuration must parse and validate without any problem.
Every configuration refused is refused only for the features the project leaves out (mixture of
experts, FP8, context parallelism, multi-latent attention, multi-token prediction, FSDP, attention
variants): OUT_OF_SCOPE_REASONS.
"""

import collections
import json
import logging
from pathlib import Path

import pytest

from megatron.training.arguments import parse_command_line
from megatron.training.config_validation import ConfigurationError, validate_config

COLLECTION = Path(__file__).resolve().parents[1] / "data" / "megatron_gpt_launch_configs.jsonl"
CONFIGS = [json.loads(line) for line in COLLECTION.read_text().splitlines() if line.strip()]

# Configurations that ask only for features we have and still fail, each with the reason: the
# test fails when one of them starts to pass (remove it here) or another one fails.
KNOWN_GAPS: dict[str, str] = {}

# Configurations that Megatron-LM refuses too, with the reason.
MEGATRON_REFUSES_TOO = {
    "canonical/train_gpt3_175b_distributed.sh@779c5b7":
        "the script expands its argument arrays unquoted, so the --step-batch-size-schedule value "
        "\"0:16 2.4B:320 ...\" reaches the parser as six words, and it gives --global-batch-size "
        "as well, which Megatron-LM refuses with a step schedule",
}


def problems_of(config: dict) -> list[str]:
    """Every problem parse and validation report for one launch configuration."""
    parsed = parse_command_line(config["argv"])
    problems = list(parsed.problems)
    try:
        validate_config(parsed.config, config["world_size"])
    except ConfigurationError as error:
        problems += error.problems
    return problems


def lacks_a_feature(problem: str) -> bool:
    return "is not implemented" in problem or "is not supported yet" in problem


@pytest.fixture(scope="module")
def verdicts():
    logging.disable(logging.WARNING)  # the collection logs hundreds of "ignored" lines
    try:
        return {config["name"]: problems_of(config) for config in CONFIGS}
    finally:
        logging.disable(logging.NOTSET)


def test_the_collection_is_what_the_docstring_says():
    groups = collections.Counter(config["name"].split("/")[0] for config in CONFIGS)
    assert groups == {"functional-2026": 118, "functional-2024": 113, "sc21": 94,
                      "canonical": 21, "examples": 2}
    assert len({config["name"] for config in CONFIGS}) == len(CONFIGS)


def test_no_flag_of_the_collection_is_unknown(verdicts):
    unknown = {name: [p for p in problems if p.startswith("unknown flag")]
               for name, problems in verdicts.items()}
    assert not {name: p for name, p in unknown.items() if p}


def test_every_configuration_with_only_our_features_parses_and_validates(verdicts):
    failing = {name: problems for name, problems in verdicts.items()
               if problems and not any(lacks_a_feature(p) for p in problems)}
    expected = set(KNOWN_GAPS) | set(MEGATRON_REFUSES_TOO)
    assert set(failing) == expected, {name: failing.get(name, "passes")
                                      for name in set(failing) ^ expected}


def test_how_many_configurations_are_accepted(verdicts):
    accepted = collections.Counter(name.split("/")[0] for name, problems in verdicts.items()
                                   if not problems)
    # Measured at this commit; a drop means a configuration that ran stopped running.
    assert accepted["sc21"] == 94 and accepted["canonical"] >= 20
    assert accepted["functional-2026"] + accepted["functional-2024"] >= MEASURED_FUNCTIONAL


# The reasons of the features the project leaves out (issue 27): mixture of experts, FP8, context
# parallelism, multi-latent attention, multi-token prediction, FSDP and attention variants.
OUT_OF_SCOPE_REASONS = (
    "mixture of experts is not implemented", "FP8 training is not implemented",
    "context parallelism is not implemented", "multi-latent attention",
    "multi-token prediction is not implemented", "FSDP is not implemented",
    "linear, windowed, gated, sparse and other attention variants are not implemented")


def is_out_of_scope(problem: str) -> bool:
    """The problem refuses a flag (or value) for one of the out-of-scope features."""
    _, separator, reason = problem.partition(" is not implemented: ")
    return bool(separator) and any(phrase in reason for phrase in OUT_OF_SCOPE_REASONS)


def test_every_refusal_is_for_an_out_of_scope_feature(verdicts):
    """Every refused configuration is refused only for out-of-scope features: none of its
    problems concerns a feature the project has or should have."""
    in_scope = {name: [problem for problem in problems if not is_out_of_scope(problem)]
                for name, problems in verdicts.items() if name not in MEGATRON_REFUSES_TOO}
    assert not {name: problems for name, problems in in_scope.items() if problems}


MEASURED_FUNCTIONAL = 174  # 89 of 118 (2026) + 85 of 113 (2024): 288 of the 348 configs in all

UNEVEN_STAGE_CONFIGS = (  # Megatron's uneven-pipeline functional tests (first/last, account-for)
    "functional-2026/gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline",
    "functional-2024/gpt3_mr_mcore_te_tp1_pp4_vp1_uneven_pipeline_dgx_a100_1N8G",
    "functional-2026/gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split",
)


def test_uneven_pipeline_stage_configurations_are_accepted(verdicts):
    assert {name: verdicts[name] for name in UNEVEN_STAGE_CONFIGS} == \
        {name: [] for name in UNEVEN_STAGE_CONFIGS}
