"""--grad-reduce-in-bf16: on DP 2 the data-parallel all-reduce (and the distributed optimizer's
reduce-scatter) runs on bfloat16 copies of the fp32 gradient buckets, as Megatron-LM reduces its
bf16 gradient buffers: every reduced gradient equals the bf16 sum of the bf16-rounded halves,
differs from the fp32 reduction by bf16 rounding only, and is back in fp32 afterwards. The flag
acts only with --bf16 (Megatron's rule) and with the exact reducer; the tied-embedding all-reduce of
a pipeline narrows the same way."""

from __future__ import annotations

import logging

import pytest
import torch

from dist_harness import run_distributed
from megatron.core.distributed.gradient_reducer import GradientReducer
from megatron.core.distributed.reducers import build_exact_reduction, grad_reduce_dtype
from megatron.core.distributed.reduction import ChunkReductionRequest
from megatron.core.distributed.sharded_reducer import ShardedGradientReducer
from megatron.training.arguments import parse_args
from megatron.training.config_validation import ConfigurationError

SHAPES = [(7, 5), (11, 1), (3, 4)]  # all matrices: one distributed-optimizer segment


def _gradients(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _expected(reduce_in_bf16):
    """Each rank's gradient divided by 2, summed: in fp32, or in bf16 as the collective does."""
    halves = [[g / 2 for g in _gradients(rank)] for rank in range(2)]
    if not reduce_in_bf16:
        return [a + b for a, b in zip(*halves)]
    return [(a.bfloat16() + b.bfloat16()).float() for a, b in zip(*halves)]


def _within_bf16_rounding(got, fp32, magnitude):
    """Three bf16 roundings (both halves and the sum), each at most 2^-8 relative (bf16 keeps 8
    significant bits): the error is
    below 2^-7 times the sum of the halves' magnitudes (a relative bound on ``fp32`` alone would
    fail where the halves cancel)."""
    return bool(((got - fp32).abs() <= 2 ** -7 * 1.01 * magnitude).all())


def _magnitudes():
    return [(a / 2).abs() + (b / 2).abs() for a, b in zip(_gradients(0), _gradients(1))]


def _reduce(rank, world_size, sharded, reduce_dtype, bucket_size):
    import torch.distributed as dist

    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    if sharded:
        reducer = ShardedGradientReducer(params, dist.group.WORLD, divide_by=world_size,
                                         reduce_dtype=reduce_dtype)
    else:
        reducer = GradientReducer(params, dist.group.WORLD, divide_by=world_size,
                                  bucket_size=bucket_size, reduce_dtype=reduce_dtype)
    for param, grad in zip(params, _gradients(rank)):
        param.grad.copy_(grad)
    reducer.start()
    reducer.wait()
    if sharded:
        return [(segment.shard.grad.clone(), reducer.shard_ranges()) for segment in
                reducer.segments], [p.grad.dtype for p in params]
    return [p.grad.clone() for p in params]


def _flat_shards(results):
    """The reduced flat gradient of the one segment, from both ranks' shards."""
    (rank0,), _ = results[0]
    (rank1,), _ = results[1]
    return torch.cat([rank0[0], rank1[0]])


@pytest.mark.parametrize("bucket_size", [None, 40])
def test_the_all_reduce_is_the_bf16_sum(bucket_size):
    narrow = run_distributed(_reduce, 2, False, torch.bfloat16, bucket_size)
    exact = run_distributed(_reduce, 2, False, None, bucket_size)
    for rank in range(2):
        for got, want, fp32, full, magnitude in zip(narrow[rank], _expected(True),
                                                    _expected(False), exact[rank],
                                                    _magnitudes()):
            assert got.dtype == torch.float32
            assert torch.equal(got, want)  # exactly the bf16 reduction ...
            assert torch.equal(full, fp32)  # ... where the plain reducer gives the fp32 one
            assert _within_bf16_rounding(got, fp32, magnitude)
    # A flag that changed nothing would leave the fp32 values.
    assert any(not torch.equal(got, fp32) for got, fp32 in zip(narrow[0], _expected(False)))


def test_the_distributed_optimizer_reduce_scatter_is_the_bf16_sum():
    narrow = run_distributed(_reduce, 2, True, torch.bfloat16, None)
    exact = run_distributed(_reduce, 2, True, None, None)
    assert narrow[0][1] == [torch.float32] * len(SHAPES)
    total = sum(torch.Size(shape).numel() for shape in SHAPES)
    want = torch.cat([g.reshape(-1) for g in _expected(True)])
    fp32 = torch.cat([g.reshape(-1) for g in _expected(False)])
    got = _flat_shards(narrow)[:total]
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert torch.equal(_flat_shards(exact)[:total], fp32)
    assert not torch.equal(got, fp32)
    assert _within_bf16_rounding(got, fp32, torch.cat([m.reshape(-1) for m in _magnitudes()]))


def _tied_reduce(rank, world_size):
    import torch.distributed as dist

    from megatron.core.distributed.reducers import TiedEmbeddingReducer

    copy = torch.nn.Parameter(torch.zeros(SHAPES[0]))
    copy.grad = _gradients(rank)[0].clone()
    reducer = TiedEmbeddingReducer([copy], dist.group.WORLD, divide_by=world_size,
                                   reduce_dtype=torch.bfloat16)
    reducer.start()
    reducer.wait()
    return copy.grad.clone()


def test_the_tied_embedding_all_reduce_is_the_bf16_sum():
    """The embedding copies of the first and last pipeline stage: summed in bf16 too."""
    for got in run_distributed(_tied_reduce, 2):
        assert got.dtype == torch.float32 and torch.equal(got, _expected(True)[0])
        assert not torch.equal(got, _expected(False)[0])


ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--lr", "0.01", "--train-iters", "1", "--mock-data", "--vocab-size", "64",
        "--grad-reduce-in-bf16"]


def test_the_flag_with_bf16_selects_bf16_collectives():
    parallel = parse_args(ARGS + ["--bf16"], world_size=2).parallel
    assert parallel.grad_reduce_in_bf16 and grad_reduce_dtype(parallel) == torch.bfloat16
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    for sharded in (False, True):  # what the runtimes build from the config
        reducer = build_exact_reduction(ChunkReductionRequest(
            params=params, key=0, replica_group=None, divide_by=2.0, parallel=parallel,
            sharded=sharded))
        assert reducer.reduce_dtype == torch.bfloat16


def test_without_bf16_the_flag_is_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        parallel = parse_args(ARGS, world_size=2).parallel
    assert not parallel.grad_reduce_in_bf16 and grad_reduce_dtype(parallel) is None
    assert any("--grad-reduce-in-bf16 is ignored without --bf16" in r.getMessage()
               for r in caplog.records)


def test_a_compressing_reducer_refuses_the_flag():
    with pytest.raises((ConfigurationError, SystemExit, ValueError), match="grad-reduce-in-bf16"):
        parse_args(ARGS + ["--bf16", "--dp-gradient-reducer", "topk"], world_size=2)


TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
         "--mock-data --seed 7 --micro-batch-size 2 --global-batch-size 8 --lr 1e-2 "
         "--train-iters 2 --log-interval 1 --eval-iters 0 --bf16")


def _train(rank, world_size, argv):
    import pretrain_gpt
    from megatron.training.training import pretrain
    from pipeline_reference import test_model_provider

    result = pretrain(parse_args(argv.split(), world_size=world_size), test_model_provider,
                      pretrain_gpt.datasets_provider, pretrain_gpt.forward_step,
                      log=lambda _: None)
    dtypes = {str(getattr(r, "reduce_dtype", None)) for r in result.components.gradient_reducers}
    return [(r.losses["lm loss"], r.grad_norm) for r in result.history], dtypes


@pytest.mark.parametrize("extra", ["", " --use-distributed-optimizer"],
                         ids=["allreduce", "distributed-optimizer"])
def test_dp2_training_reduces_in_bf16(extra):
    """A DP 2 bf16 run with the flag builds bf16 reductions and trains; the first loss is the
    same (the reduction comes after it), the gradient norm differs from the fp32 reduction's by
    bf16 rounding only."""
    narrow = run_distributed(_train, 2, TRAIN + extra + " --grad-reduce-in-bf16", timeout=240)
    exact = run_distributed(_train, 2, TRAIN + extra, timeout=240)
    (records, dtypes), (exact_records, exact_dtypes) = narrow[0], exact[0]
    assert dtypes == {"torch.bfloat16"} and exact_dtypes == {"None"}
    assert records[0][0] == exact_records[0][0]
    norm, exact_norm = records[0][1], exact_records[0][1]
    assert norm != exact_norm and norm == pytest.approx(exact_norm, rel=2 ** -6)
