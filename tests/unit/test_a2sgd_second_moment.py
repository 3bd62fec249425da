"""Adam's second moment shaped by A2SGD's exact steps only (``--a2sgd-second-moment-from-exact-steps``)."""

import pytest
import torch

from megatron.core.distributed.a2sgd import A2SGDReducer, check_a2sgd_flags
from megatron.core.distributed.a2sgd_second_moment import SecondMomentFromExactSteps
from megatron.training.arguments import parse_args

BETA2, INTERVAL = 0.9, 3


def _adam_and_keeper():
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, betas=(0.5, BETA2))
    keeper = SecondMomentFromExactSteps([param], INTERVAL)
    keeper.attach(optimizer)
    return param, optimizer, keeper


def _step(param, optimizer, keeper, grad, exact, ok=True):
    param.grad = torch.tensor(grad)
    keeper.before_step(exact)
    if ok:
        optimizer.step()
    keeper.after_step(ok)
    return optimizer.state[param]["exp_avg_sq"].clone() if param in optimizer.state else None


def test_an_exact_step_weights_its_gradient_over_the_interval():
    param, optimizer, keeper = _adam_and_keeper()
    first = [1.0, -2.0, 0.5, 0.0]
    v = _step(param, optimizer, keeper, first, exact=True)
    decay = BETA2 ** INTERVAL
    assert torch.allclose(v, (1 - decay) * torch.tensor(first) ** 2)
    second = [3.0, 1.0, -1.0, 2.0]
    v2 = _step(param, optimizer, keeper, second, exact=True)
    assert torch.allclose(v2, decay * v + (1 - decay) * torch.tensor(second) ** 2)


def test_a_two_level_step_leaves_the_second_moment_but_still_moves_the_parameters():
    param, optimizer, keeper = _adam_and_keeper()
    v = _step(param, optimizer, keeper, [1.0, -2.0, 0.5, 0.1], exact=True)
    before = param.detach().clone()
    v_after = _step(param, optimizer, keeper, [5.0, 5.0, -5.0, 5.0], exact=False)
    assert torch.equal(v_after, v)
    assert not torch.equal(param.detach(), before)
    assert torch.equal(optimizer.state[param]["exp_avg"] != 0, torch.ones(4, dtype=torch.bool))


def test_a_skipped_step_changes_nothing():
    param, optimizer, keeper = _adam_and_keeper()
    v = _step(param, optimizer, keeper, [1.0, -2.0, 0.5, 0.1], exact=True)
    assert torch.equal(_step(param, optimizer, keeper, [9.0] * 4, exact=True, ok=False), v)


def test_it_needs_adam_and_the_optimizers_own_parameters():
    param = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="--optimizer adam"):
        SecondMomentFromExactSteps([param], 2).attach(torch.optim.SGD([param], lr=0.1))
    other = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not the optimizer's own"):
        SecondMomentFromExactSteps([param], 2).attach(torch.optim.AdamW([other]))


def test_the_reducer_needs_the_flush_and_starts_with_an_exact_step():
    param = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="--a2sgd-sync-flushes-errors"):
        A2SGDReducer([param], sync_interval=2, second_moment_from_exact_steps=True)
    reducer = A2SGDReducer([param], sync_interval=2, flush_errors_at_sync=True,
                           second_moment_from_exact_steps=True)
    assert reducer.exact_next_step and reducer.second_moment is not None
    assert not A2SGDReducer([param], sync_interval=2, flush_errors_at_sync=True).exact_next_step


def test_the_flag_is_checked_against_the_flush():
    tiny = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 2 --mock-data "
            "--dp-gradient-reducer a2sgd --a2sgd-second-moment-from-exact-steps").split()
    with pytest.raises(ValueError, match="--a2sgd-sync-flushes-errors"):
        check_a2sgd_flags(parse_args(tiny, world_size=1).parallel)
    check_a2sgd_flags(parse_args(tiny + ["--a2sgd-sync-flushes-errors"], world_size=1).parallel)
