"""Tier 0: the flag parser and validation ask the schedule registry they are given.

``--pipeline-schedule``'s choices are the registry's families; validation selects the family
(``--pipeline-schedule``, a family's ``selected_by`` flag, else the registry's default), applies the
family's ``derive_config`` hook (interleaved 1F1B's rules live in its module) and its ``check``.
No project file outside a family's module compares a schedule name.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from megatron.core.config import ParallelConfig
from megatron.core.pipeline_parallel.planning.schedules import (
    BUILTIN_SCHEDULES, ScheduleFamily, ScheduleRegistry)
from megatron.core.pipeline_parallel.planning.schedules.interleaved import (
    derive_interleaved_config)
from megatron.core.pipeline_parallel.planning.schedules.layout import single_pipeline_layout
from megatron.core.pipeline_parallel.planning.schedules.one_f_one_b import build_one_f_one_b
from megatron.training.arguments import build_parser, parse_args, parse_command_line
from megatron.training.config_validation import ConfigurationError, validate_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --lr 1e-3 --train-iters 1 "
        "--micro-batch-size 1 --global-batch-size 4 --pipeline-model-parallel-size 2").split()


def _three_layer_stages(parallel_config, num_layers: int) -> dict:
    """A toy family's config rule: exactly 3 layers per stage."""
    if num_layers != 3 * parallel_config.pipeline_model_parallel_size:
        raise ValueError(f"three-layer-1f1b needs --num-layers = 3 x "
                         f"--pipeline-model-parallel-size, got {num_layers}")
    return {}


THREE_LAYER = ScheduleFamily(
    name="three-layer-1f1b", description="1F1B with 3 layers per stage (test only)",
    build=build_one_f_one_b, derive_config=_three_layer_stages,
    layout=lambda pipeline_size: single_pipeline_layout("three-layer-1f1b", pipeline_size))
REGISTRY = BUILTIN_SCHEDULES.with_family(THREE_LAYER)


def test_choices_come_from_the_registry():
    assert BUILTIN_SCHEDULES.choices == ("1f1b", "gpipe", "interleaved-1f1b", "chimera")
    assert REGISTRY.choices[-1] == "three-layer-1f1b" and REGISTRY.default_name == "1f1b"
    assert "three-layer-1f1b" in build_parser(REGISTRY).format_help()
    assert "three-layer-1f1b" not in build_parser().format_help()
    parsed = parse_command_line(TINY + ["--pipeline-schedule", "three-layer-1f1b"])
    assert any("three-layer-1f1b" in problem and "chimera" in problem
               for problem in parsed.problems)  # names the value and the allowed ones
    assert not parse_command_line(TINY + ["--pipeline-schedule", "three-layer-1f1b"],
                                  REGISTRY).problems


def test_validation_applies_the_chosen_familys_config_rule():
    argv = TINY + ["--pipeline-schedule", "three-layer-1f1b"]
    # 4 layers split evenly over D = 2 (the default rule would accept them); the family's own
    # rule replaces it.
    with pytest.raises(ValueError, match="three-layer-1f1b needs --num-layers = 3 x"):
        parse_args(argv, world_size=2, registry=REGISTRY)
    config = parse_args([*argv, "--num-layers", "6"], world_size=2, registry=REGISTRY)
    assert config.parallel.pipeline_schedule == "three-layer-1f1b"
    # Without --pipeline-schedule the default family's rule applies: 5 layers do not split
    # over D = 2.
    with pytest.raises(ConfigurationError, match="is not divisible by"):
        validate_config(parse_command_line([*TINY, "--num-layers", "5"]).config, 2)


def test_interleaved_rules_live_in_the_family_hook():
    parallel = dataclasses.replace(ParallelConfig(), pipeline_model_parallel_size=2,
                                   num_layers_per_virtual_pipeline_stage=2)
    assert derive_interleaved_config(parallel, 8) == {"virtual_pipeline_model_parallel_size": 2}
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by "
                                         "--pipeline-model-parallel-size 2 x"):
        derive_interleaved_config(parallel, 6)
    with pytest.raises(ValueError, match="needs --num-layers-per-virtual-pipeline-stage"):
        derive_interleaved_config(dataclasses.replace(
            parallel, num_layers_per_virtual_pipeline_stage=None), 8)
    # The selecting flag picks the family, and conflicts with another --pipeline-schedule.
    assert BUILTIN_SCHEDULES.select(parallel) == "interleaved-1f1b"
    with pytest.raises(ValueError, match="selects the interleaved-1f1b schedule and conflicts "
                                         "with --pipeline-schedule chimera"):
        BUILTIN_SCHEDULES.select(dataclasses.replace(parallel, pipeline_schedule="chimera"))
    assert BUILTIN_SCHEDULES.select(ParallelConfig()) == "1f1b"


def test_registry_refuses_an_unknown_default():
    with pytest.raises(ValueError, match="default schedule 'nope' is not registered"):
        ScheduleRegistry(BUILTIN_SCHEDULES.families, default="nope")


SCHEDULE_NAME_COMPARISON = re.compile(
    r'[=!]=\s*"(gpipe|1f1b|interleaved-1f1b|chimera)[^"]*"'
    r'|"(gpipe|1f1b|interleaved-1f1b|chimera)[^"]*"\s*[=!]='
    r'|in \([^)]*"(gpipe|1f1b|interleaved-1f1b|chimera)"')


@pytest.mark.parametrize("relative", [
    "megatron/training/config_validation.py", "megatron/training/arguments.py",
    "megatron/training/hf_checkpoint.py", "megatron/training/checkpoint_conversion.py",
    "megatron/training/checkpointing/state.py", "megatron/performance_model/schemes.py",
    "megatron/performance_model/planner.py", "megatron/performance_model/timing.py",
    "megatron/performance_model/memory.py"])
def test_consumers_do_not_branch_on_schedule_names(relative):
    with open(os.path.join(ROOT, relative)) as handle:
        source = handle.read()
    assert not SCHEDULE_NAME_COMPARISON.search(source), SCHEDULE_NAME_COMPARISON.search(source)


def test_an_indivisible_layer_count_names_the_uneven_stage_flags_as_a_fix():
    from megatron.core.pipeline_parallel.planning.schedules.family import even_stage_config
    parallel = dataclasses.replace(ParallelConfig(), pipeline_model_parallel_size=4)
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by "
                                         "--pipeline-model-parallel-size 4; choose a multiple of "
                                         "4, or .*--decoder-first-pipeline-num-layers"):
        even_stage_config(parallel, 6)
    uneven = dataclasses.replace(parallel, decoder_first_pipeline_num_layers=3,
                                 decoder_last_pipeline_num_layers=1)
    assert even_stage_config(uneven, 6) == {}
