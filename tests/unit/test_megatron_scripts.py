"""The flag lines of three real Megatron-LM launch scripts parse unchanged (paths replaced).
The flag lists live in tests/megatron_scripts.py."""

import logging

import pytest

from megatron.training.arguments import accepted_flags, parse_args
from megatron.training.megatron_flags import UNIMPLEMENTED_FLAGS
from megatron_scripts import (DISTRIBUTED_WITH_MP, GPT3_175B, GPT3_175B_DISTRIBUTED, SCRIPTS,
                              script_argv, with_value)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_the_script_is_accepted(name):
    flags = {token for token in script_argv(SCRIPTS[name]) if token.startswith("--")}
    unimplemented = {flag.flag for flag in UNIMPLEMENTED_FLAGS}
    assert flags <= set(accepted_flags()), flags - set(accepted_flags())
    assert not flags & unimplemented


def test_distributed_with_mp_parses_at_its_scale():
    config = parse_args(script_argv(DISTRIBUTED_WITH_MP), world_size=8)
    assert (config.parallel.tensor_model_parallel_size, config.parallel.data_parallel_size,
            config.parallel.pipeline_model_parallel_size) == (2, 2, 2)
    assert config.recompute.recompute_granularity == "full"
    assert config.training.num_microbatches == 2  # 16 / (micro-batch 4 x DP 2)


def test_gpt3_175b_samples_based_script():
    argv = script_argv(GPT3_175B)
    # At its own scale (TP 8, PP 16, DP 8) the unchanged flags parse with Megatron's numbers,
    # including the batch-size ramp-up under 1F1B (micro-batch counts 2, 4, ..., 192).
    config = parse_args(argv, world_size=1024)
    assert (config.parallel.tensor_model_parallel_size,
            config.parallel.pipeline_model_parallel_size,
            config.parallel.data_parallel_size) == (8, 16, 8)
    assert config.training.rampup_batch_size == [16, 16, 5859375]
    assert config.optimizer.lr_decay_samples == 126953125
    assert config.optimizer.lr_warmup_samples == 183105
    # Megatron's count: ramp-up iterations one by one (batch 16k for 5859375 / 95 samples each,
    # about 3855 / k iterations, k = 1..95: ~19 800), then (146484375 - ~5.86e6) / 1536 ~ 91 550
    ramp = sum(5859375 / 95 / (16 * k) for k in range(1, 96))
    assert config.training.train_iters == pytest.approx(ramp + (146484375 - 5859375) / 1536,
                                                        abs=100)


def test_gpt3_175b_distributed_script_logs_its_ignored_flag(caplog):
    argv = with_value(script_argv(GPT3_175B_DISTRIBUTED), "--pipeline-model-parallel-size", "1")
    with caplog.at_level(logging.WARNING, logger="megatron.training.arguments"):
        config = parse_args(argv, world_size=128)
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1 and ignored[0].startswith("--attention-backend")
    assert config.training.rampup_batch_size == [16, 16, 5859375]
    config = parse_args(script_argv(GPT3_175B_DISTRIBUTED), world_size=1024)
    assert config.parallel.pipeline_model_parallel_size == 16
