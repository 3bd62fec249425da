"""pretrain_gpt.py shows the command line's warnings once per launch (rank 0), not once per rank."""

import contextlib
import logging

import pytest

import pretrain_gpt
from megatron.training.logging_utils import CommandLineWarningsOnce

# A compatibility flag (logged as ignored) plus a world size the layout cannot use, so the run stops
# in its configuration step, before any process group, after the warnings were logged.
ARGV = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data "
        "--pipeline-model-parallel-size 4 --attention-backend auto").split()


@contextlib.contextmanager
def bare_root_logger():
    """The root logger without pytest's handlers (added for the test call itself), so the entry
    point installs its own; restored afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers = []
    try:
        yield root
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)


@pytest.mark.parametrize("rank,shown", [("0", True), ("1", False), ("3", False)])
def test_ignored_flag_warning_is_printed_by_rank_0_only(rank, shown, capsys, monkeypatch):
    for name in ("SLURM_NTASKS", "SLURM_PROCID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "6")  # not a multiple of PP 4: exits with status 2
    monkeypatch.setenv("RANK", rank)
    with bare_root_logger(), pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(ARGV)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "world size 6 is not divisible" in error  # every rank still says why it stops
    assert ("--attention-backend is accepted for compatibility and ignored" in error) == shown


def test_other_loggers_pass_on_every_rank():
    record = logging.LogRecord("megatron.training.rerun", logging.WARNING, __file__, 1,
                               "rank 3: injecting an error", None, None)
    assert CommandLineWarningsOnce(rank=3).filter(record)
    record.name = "megatron.training.arguments"
    assert not CommandLineWarningsOnce(rank=3).filter(record)
    assert CommandLineWarningsOnce(rank=0).filter(record)
