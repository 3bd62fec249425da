"""Tier 0: where Megatron-LM is lenient with a flag, so are we (and say so in the log)."""

import logging

import pytest

from megatron.training.arguments import parse_args

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 --mock-data").split()


def test_sequence_parallel_without_tensor_parallelism_is_switched_off_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        config = parse_args(TINY + ["--sequence-parallel"], world_size=1)
    assert config.parallel.sequence_parallel is False
    assert any("--sequence-parallel is switched off" in r.getMessage() for r in caplog.records)


def test_sequence_parallel_with_tensor_parallelism_stays_on():
    config = parse_args(TINY + ["--sequence-parallel", "--tensor-model-parallel-size", "2"],
                        world_size=2)
    assert config.parallel.sequence_parallel is True


@pytest.mark.parametrize("split", ["'99,1,0'", '"99,1,0"', "99,1,0"])
def test_a_split_with_the_scripts_quotes_reads_the_numbers(split):
    assert parse_args(TINY + ["--split", split], world_size=1).data.split == "99,1,0"


@pytest.mark.parametrize("flags", [["--recompute-num-layers", "1"],
                                   ["--recompute-method", "uniform", "--recompute-num-layers", "2"],
                                   ["--recompute-granularity", "selective",
                                    "--recompute-num-layers", "1"]])
def test_recompute_details_without_full_granularity_are_ignored_with_a_warning(flags, caplog):
    with caplog.at_level(logging.WARNING):
        config = parse_args(TINY + flags, world_size=1)
    assert config.recompute.recompute_method is None
    assert config.recompute.recompute_num_layers is None
    assert any("is ignored: it only applies to --recompute-granularity full" in r.getMessage()
               for r in caplog.records)
