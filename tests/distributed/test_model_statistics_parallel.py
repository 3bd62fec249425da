"""--log-params-norm and --log-num-zeros-in-grad on several ranks report the whole model's numbers:
the same as one process, with and without --use-distributed-optimizer (whose ranks step shards of
the parameters, padded to the replica count: the padding is neither a parameter nor a zero
gradient), on data parallelism, tensor parallelism and under Chimera. Before the fix the distributed optimizer's
ranks counted only the parameters it steps whole (the tied embedding's copies): ``params norm:
0.000`` with untied embeddings."""

from __future__ import annotations

import pytest

import pretrain_gpt
from dist_harness import run_distributed
from pipeline_reference import test_model_provider as float64_model
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 100 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 "
        "--train-iters 2 --log-interval 1 --eval-iters 0 --log-params-norm "
        "--log-num-zeros-in-grad --untie-embeddings-and-output-weights")


# The padded vocabulary's 28 rows of the (untied) input embedding are never looked up: their
# gradients are zero, on any number of ranks.
PADDED_ROWS = (128 - 100) * 32


def _statistics(rank, world_size, argv):
    config = parse_args(argv.split(), world_size=world_size)
    state = ParallelState.single_process() if world_size == 1 else None
    lines: list[str] = []
    pretrain(config, float64_model, pretrain_gpt.datasets_provider, pretrain_gpt.forward_step,
             parallel_state=state, log=lines.append)
    return [(_field(line, "params norm"), _field(line, "num zeros"))
            for line in lines if " iteration " in line and " params norm: " in line]


def _field(line: str, name: str) -> float:
    return float(line.split(f" {name}: ")[1].split(" |")[0])


@pytest.mark.parametrize("layout", [
    "", "--pipeline-model-parallel-size 2 --pipeline-schedule chimera"], ids=["dp2", "chimera-pp2"])
@pytest.mark.parametrize("optimizer", ["", "--use-distributed-optimizer"],
                         ids=["replicated", "distributed"])
def test_statistics_match_one_process(layout, optimizer):
    single = _statistics(0, 1, f"{TINY} {layout}".replace(
        "--pipeline-model-parallel-size 2 --pipeline-schedule chimera", ""))
    logged = [lines for lines in run_distributed(_statistics, 2, f"{TINY} {layout} {optimizer}",
                                                 timeout=120) if lines]
    assert len(single) == 2 and len(logged) == 1
    for (norm, zeros), (one_norm, one_zeros) in zip(logged[0], single):
        assert norm == pytest.approx(one_norm, abs=1e-3)  # the log line rounds to 3 decimals
        # Beyond the padded rows a gradient element can be zero by cancellation, which depends on
        # the order of the sums (one process, an all-reduce, a reduce-scatter): a few either way.
        assert zeros >= PADDED_ROWS and abs(zeros - one_zeros) <= 4


def test_distributed_optimizer_statistics_match_the_replicated_ones_on_tp2_dp2():
    """Tensor parallelism initializes another model than one process: the reference is the
    replicated optimizer on the same ranks (a tensor-parallel shard counts on every rank)."""
    argv = f"{TINY} --tensor-model-parallel-size 2"
    replicated = [lines for lines in run_distributed(_statistics, 4, argv, timeout=120) if lines]
    sharded = [lines for lines in run_distributed(
        _statistics, 4, f"{argv} --use-distributed-optimizer", timeout=120) if lines]
    assert len(replicated[0]) == 2
    for (norm, zeros), (ref_norm, ref_zeros) in zip(sharded[0], replicated[0]):
        assert norm == pytest.approx(ref_norm, abs=1e-3)
        assert zeros >= PADDED_ROWS and abs(zeros - ref_zeros) <= 4
