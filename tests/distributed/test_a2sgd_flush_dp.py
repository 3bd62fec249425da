"""``--a2sgd-sync-flushes-errors`` over two gloo data-parallel ranks.

With gradients that do not depend on the weights (a linear loss) and plain SGD, a flushing sync
makes A2SGD catch up with exact all-reduce SGD: right after each exact step (the step after a
sync) the replicas equal the all-reduce trajectory, because the parameter average plus every
rank's unapplied error is the sum of every mean gradient so far. Without the flag the error stays
behind and the replicas do not catch up. And a real training run with the flag keeps the
replicas identical after every exact step.
"""

import types

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from dist_harness import run_distributed
from megatron.core.distributed.a2sgd import A2SGDReducer
from megatron.core.parallel_state import RankLayout, create_parallel_state
from megatron.core.runtimes import select_runtime_class
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

pytestmark = pytest.mark.distributed

SIZE, STEPS, INTERVAL, LR = 64, 7, 3, 0.1


def _gradient(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(1000 * step + rank))


def _rank_linear_sgd(rank, world_size, flush):
    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.zeros(SIZE))
    param.grad = torch.zeros(SIZE)
    reducer = A2SGDReducer([param], data_group=dist.group.WORLD, sync_interval=INTERVAL,
                           flush_errors_at_sync=flush)
    reducer.inner.rebind_all()
    exact = torch.zeros(SIZE, dtype=torch.float64)
    after_exact_steps = []
    for step in range(1, STEPS + 1):
        exact_step = reducer.exact_next_step
        reducer.zero_grad()
        param.grad.copy_(_gradient(rank, step))
        reducer.wait()
        with torch.no_grad():
            param.sub_(LR * param.grad)
        reducer.finish_step(True)
        exact -= LR * sum(_gradient(r, step).double() for r in range(world_size)) / world_size
        if step % INTERVAL == 0:
            reducer.synchronize()
        if step > 1 and (step - 1) % INTERVAL == 0:
            after_exact_steps.append((step, exact_step, param.detach().double().clone(),
                                      exact.clone()))
    return after_exact_steps


def test_flushing_syncs_catch_up_with_exact_all_reduce_sgd():
    for rank_result in run_distributed(_rank_linear_sgd, 2, True, timeout=60):
        assert [step for step, _, _, _ in rank_result] == [4, 7]
        for step, exact_step, mine, reference in rank_result:
            assert exact_step, f"step {step} after a sync was not exact"
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)


def test_without_the_flag_the_replicas_stay_behind():
    for rank_result in run_distributed(_rank_linear_sgd, 2, False, timeout=60):
        for step, exact_step, mine, reference in rank_result:
            assert not exact_step
            assert (mine - reference).abs().max() > 1e-2, f"step {step} caught up without a flush"


TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 128 --make-vocab-size-divisible-by 64 "
        "--mock-data --seed 7 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 "
        "--log-interval 1 --eval-iters 0 --dp-gradient-reducer a2sgd "
        "--a2sgd-sync-interval 2 --a2sgd-sync-flushes-errors --train-iters 3")


def _rank_train(rank, world_size, argv):
    torch.set_num_threads(1)
    config = parse_args(argv.split(), world_size=world_size)
    runtime_class = select_runtime_class(config)
    layout = RankLayout.from_world_size(world_size, 1, 1)
    state = create_parallel_state(layout, rank, "gloo",
                                  extra_group_ranks=runtime_class.required_group_ranks(config,
                                                                                       layout))
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=state, log=lambda _: None)
    reducers = [r for r in result.components.gradient_reducers if isinstance(r, A2SGDReducer)]
    return {"exact": [r.bytes_last_step for r in reducers],
            "params": [p.detach().clone() for c in result.components.model_chunks
                       for p in c.parameters()]}


@pytest.mark.parametrize("extra", ["", " --a2sgd-second-moment-from-exact-steps"])
def test_training_with_the_flag_keeps_replicas_identical_after_the_exact_step(extra):
    # iteration 2 syncs, iteration 3 is the exact step: the replicas stay identical after it
    # (with the second moment from exact steps too: iteration 1 is exact, 2 two-level)
    ranks = run_distributed(_rank_train, 2, TINY + extra, timeout=120)
    for mine, theirs in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(mine, theirs)
    numel = sum(p.numel() for p in ranks[0]["params"])
    assert sum(ranks[0]["exact"]) >= 4 * numel * 0.9  # a gradient-sized all-reduce, not 4 numbers


def _rank_periodic_sync(rank, world_size, averages_optimizer):
    """Each rank: distinct parameters and Adam moments; the periodic sync, then the full one."""
    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.full((SIZE,), float(rank)))
    optimizer = torch.optim.Adam([param])
    optimizer.state[param] = {"exp_avg": torch.full((SIZE,), 10.0 * rank),
                              "exp_avg_sq": torch.full((SIZE,), 100.0 * rank)}
    reducer = A2SGDReducer([param], data_group=dist.group.WORLD, sync_interval=INTERVAL,
                           periodic_sync_averages_optimizer=averages_optimizer)
    reducer.attach(types.SimpleNamespace(loss_scale=1.0, optimizer=optimizer))
    snapshot = lambda: (param.detach().clone(),  # noqa: E731
                        optimizer.state[param]["exp_avg"].clone())
    reducer.synchronize_periodically()
    periodic = snapshot()
    reducer.synchronize()
    return periodic, snapshot()


@pytest.mark.parametrize("averages_optimizer", [True, False])
def test_the_periodic_sync_averages_the_optimizer_state_only_when_asked(averages_optimizer):
    results = run_distributed(_rank_periodic_sync, 2, averages_optimizer, timeout=60)
    for rank, ((param, exp_avg), (full_param, full_exp_avg)) in enumerate(results):
        assert torch.equal(param, torch.full((SIZE,), 0.5))  # parameters: always averaged
        expected = 5.0 if averages_optimizer else 10.0 * rank
        assert torch.equal(exp_avg, torch.full((SIZE,), expected))
        # the sync before a checkpoint or an evaluation averages both
        assert torch.equal(full_param, torch.full((SIZE,), 0.5))
        assert torch.equal(full_exp_avg, torch.full((SIZE,), 5.0))


def _rank_sync_after_a_resume(rank, world_size):
    """Each rank: attach, then load distinct Adam moments as a resume does (``load_state_dict``
    replaces the optimizer's ``state`` dict); then the full sync."""
    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.full((SIZE,), float(rank)))
    optimizer = torch.optim.Adam([param])
    reducer = A2SGDReducer([param], data_group=dist.group.WORLD, sync_interval=INTERVAL)
    reducer.attach(types.SimpleNamespace(loss_scale=1.0, optimizer=optimizer))
    saved = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((SIZE,), 10.0 * rank),
                           "exp_avg_sq": torch.full((SIZE,), 100.0 * rank)}},
             "param_groups": optimizer.state_dict()["param_groups"]}
    optimizer.load_state_dict(saved)
    reducer.synchronize()
    return optimizer.state[param]["exp_avg"].clone()


def test_the_sync_averages_the_optimizer_state_loaded_after_attach():
    for exp_avg in run_distributed(_rank_sync_after_a_resume, 2, timeout=60):
        assert torch.equal(exp_avg, torch.full((SIZE,), 5.0))
