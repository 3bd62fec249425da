"""Data and tensor parallelism on gloo ranks reproduce one process; the gradient reducer and the
fp16 overflow check work across ranks."""

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.distributed import GradientReducer
from megatron.core.optimizer import build_optimizer
from megatron.core.parallel_state import ParallelState, RankLayout, create_parallel_state
from megatron.core.tensor_parallel.utils import gather_full_state
from megatron.training.arguments import parse_args
from megatron.training.initialize import initialize_megatron
from megatron.training.training import pretrain

pytestmark = pytest.mark.distributed

# Dropout stays on (masks are keyed by global sample ids) and clipping is active (clip 0.05 is far
# below the norm), so the norm's deduplication across TP ranks is exercised.
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 --mock-data "
        "--seed 7 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-2 --train-iters 3 --log-interval 1 --eval-iters 0 "
        "--clip-grad 0.05 --layout-invariant-attention-dropout")


def _train(argv: str, world_size: int, parallel_state=None):
    config = parse_args(argv.split(), world_size=world_size)
    if parallel_state is None:
        parallel_state = initialize_megatron(config, env={})
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=parallel_state, log=lambda _: None)
    model = result.components.model_chunks[0]
    # numpy, not tensors: tensors may travel through shared memory that a finished rank takes away
    params = {name: value.numpy() for name, value in gather_full_state(model, parallel_state).items()}
    records = [(r.losses["lm loss"], r.grad_norm) for r in result.history]
    return records, params


def _rank_train(rank, world_size, argv):
    return _train(argv, world_size)


@pytest.fixture(scope="module")
def single_process_run():
    return _train(TINY, 1, ParallelState.single_process())


@pytest.mark.parametrize("layout", ["", "--tensor-model-parallel-size 2",
                                    "--overlap-grad-reduce"],
                         ids=["dp2", "tp2", "dp2-overlap"])
def test_two_ranks_reproduce_one_process(single_process_run, layout):
    reference_records, reference_params = single_process_run
    results = run_distributed(_rank_train, 2, f"{TINY} {layout}", timeout=120)
    for records, params in results:
        for (loss, norm), (ref_loss, ref_norm) in zip(records, reference_records):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert params.keys() == reference_params.keys()
        # Adam divides by sqrt(v): for a gradient element near zero, float-summation noise of the
        # other layout moves the update by up to ~1e-4 x lr, hence the absolute tolerance.
        for name, value in params.items():
            torch.testing.assert_close(torch.from_numpy(value),
                                       torch.from_numpy(reference_params[name]), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")


def _reducer_ranks(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    # bucket_size 10 splits the 30 elements over several all-reduces
    reducer = GradientReducer(params, dist.group.WORLD, divide_by=world_size, bucket_size=10)
    assert len(reducer.buckets) > 1
    views_kept = []
    for step in range(2):
        reducer.zero_grad()
        if step == 1:
            params[0].grad = None  # e.g. someone zeroed with set_to_none: the reducer recovers
        model(torch.full((1, 3), float(rank + 1))).sum().backward()
        reducer.start()
        reducer.wait()
        views_kept.append(all(p.grad.data_ptr() >= reducer.buffers[torch.float32].data_ptr()
                              for p in params))
    return [p.grad.numpy().copy() for p in params], views_kept


def test_gradient_reducer_averages_over_the_group():
    results = run_distributed(_reducer_ranks, 2, timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for rank in range(2):  # the average of the two ranks' gradients, computed in one process
        model(torch.full((1, 3), float(rank + 1))).sum().mul(0.5).backward()
    for grads, views_kept in results:
        assert views_kept == [True, True]
        for grad, param in zip(grads, model.parameters()):
            torch.testing.assert_close(torch.from_numpy(grad), param.grad)


def _overflow_on_rank_one(rank, world_size):
    layout = RankLayout.from_world_size(world_size, 1, 1)
    state = create_parallel_state(layout, rank, "gloo")
    config = parse_args("--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 4 "
                        "--mock-data --lr 0.1 --train-iters 1 --fp16 --initial-loss-scale 64 "
                        "--hysteresis 1 --global-batch-size 2".split(), world_size=world_size)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(config, model.parameters(), state)
    optimizer.scale_loss(model(torch.ones(1, 2)).sum()).backward()
    if rank == 1:
        model.weight.grad[0, 0] = float("inf")
    result = optimizer.step()
    return result.update_successful, result.found_inf, optimizer.loss_scale


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    assert run_distributed(_overflow_on_rank_one, 2) == [(False, True, 32.0)] * 2


def _overlap_ranks(rank, world_size, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    reducer = GradientReducer(model.parameters(), dist.group.WORLD, divide_by=world_size,
                              bucket_size=8, overlap=overlap)
    launched_during_backward = []
    for step in range(2):
        reducer.zero_grad()
        for microbatch in range(2):
            if microbatch == 1:
                reducer.start_when_ready()
            model(torch.full((1, 3), float(rank + microbatch + step))).sum().backward()
        launched_during_backward.append(sum(b.handle is not None for b in reducer.buckets))
        reducer.start()
        reducer.wait()
    return [p.grad.numpy().copy() for p in model.parameters()], launched_during_backward


def test_overlapped_reduction_starts_in_the_backward_and_gives_the_same_gradients():
    plain = run_distributed(_overlap_ranks, 2, False)
    overlapped = run_distributed(_overlap_ranks, 2, True)
    buckets = 3  # 10 + 20 + 16 elements (last layer first) in buckets of >= 8
    for (grads, launched), (reference, not_launched) in zip(overlapped, plain):
        assert not_launched == [0, 0]
        assert launched == [buckets, buckets]
        for grad, expected in zip(grads, reference):
            assert (grad == expected).all()
