"""Adam's second moment shaped by A2SGD's exact steps only (``--a2sgd-second-moment-from-exact-steps``)."""

import types

import pytest
import torch

from megatron.core.distributed.a2sgd import A2SGDReducer, check_a2sgd_flags
from megatron.core.distributed.a2sgd_second_moment import SecondMomentFromExactSteps
from megatron.training.arguments import parse_args

BETA2 = 0.9


def _adam_and_keeper():
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([param], lr=0.1, betas=(0.5, BETA2))
    keeper = SecondMomentFromExactSteps([param])
    keeper.attach(optimizer)
    return param, optimizer, keeper


def _step(param, optimizer, keeper, grad, exact, ok=True):
    param.grad = torch.tensor(grad)
    keeper.before_step(exact)
    if ok:
        optimizer.step()
    keeper.after_step(ok)
    return optimizer.state[param]["exp_avg_sq"].clone() if param in optimizer.state else None


def test_with_every_step_exact_the_second_moment_is_plain_adams():
    """Consecutive exact steps each stand for one of Adam's steps (exponent 1), whatever the
    sync interval: the keeper then changes nothing."""
    param, optimizer, keeper = _adam_and_keeper()
    reference = torch.nn.Parameter(torch.zeros(4))
    plain = torch.optim.AdamW([reference], lr=0.1, betas=(0.5, BETA2))
    for gradient in ([1.0, -2.0, 0.5, 0.0], [3.0, 1.0, -1.0, 2.0], [0.5, 0.5, 4.0, -1.0]):
        reference.grad = torch.tensor(gradient)
        plain.step()
        v = _step(param, optimizer, keeper, gradient, exact=True)
        assert torch.allclose(v, plain.state[reference]["exp_avg_sq"])
        assert torch.allclose(param.detach(), reference.detach())


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
        SecondMomentFromExactSteps([param]).attach(torch.optim.SGD([param], lr=0.1))
    other = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not the optimizer's own"):
        SecondMomentFromExactSteps([param]).attach(torch.optim.AdamW([other]))


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


def test_the_first_exact_step_is_adams_own_first_step():
    """Step 1 has no earlier steps: v = (1 - beta2) g^2, what Adam itself computes, so that its
    bias correction 1 - beta2^t stays right."""
    param, optimizer, keeper = _adam_and_keeper()
    gradient = [1.0, -2.0, 0.5, 3.0]
    reference = torch.nn.Parameter(torch.zeros(4))
    plain = torch.optim.AdamW([reference], lr=0.1, betas=(0.5, BETA2))
    reference.grad = torch.tensor(gradient)
    plain.step()
    v = _step(param, optimizer, keeper, gradient, exact=True)
    assert torch.allclose(v, (1 - BETA2) * torch.tensor(gradient) ** 2)
    assert torch.allclose(v, plain.state[reference]["exp_avg_sq"])
    assert torch.allclose(param.detach(), reference.detach())


def test_an_exact_step_weights_its_gradient_over_the_steps_since_the_last_exact_one():
    """Exact, three two-level steps, exact: the second exact step stands for 4 of Adam's steps."""
    param, optimizer, keeper = _adam_and_keeper()
    first = torch.tensor([1.0, -2.0, 0.5, 0.25])
    v1 = _step(param, optimizer, keeper, first.tolist(), exact=True)
    for _ in range(3):
        _step(param, optimizer, keeper, [5.0, 5.0, -5.0, 5.0], exact=False)
    last = torch.tensor([3.0, 1.0, -1.0, 2.0])
    v2 = _step(param, optimizer, keeper, last.tolist(), exact=True)
    assert torch.allclose(v2, BETA2 ** 4 * v1 + (1 - BETA2 ** 4) * last ** 2)


def test_a_skipped_step_does_not_count_as_one_of_adams_steps():
    param, optimizer, keeper = _adam_and_keeper()
    v1 = _step(param, optimizer, keeper, [1.0, -2.0, 0.5, 0.25], exact=True)
    _step(param, optimizer, keeper, [5.0, 5.0, -5.0, 5.0], exact=False)
    _step(param, optimizer, keeper, [9.0] * 4, exact=False, ok=False)  # e.g. an overflow
    _step(param, optimizer, keeper, [9.0] * 4, exact=True, ok=False)  # a skipped exact step
    last = torch.tensor([3.0, 1.0, -1.0, 2.0])
    v2 = _step(param, optimizer, keeper, last.tolist(), exact=True)
    assert int(optimizer.state[param]["step"]) == 3
    assert torch.allclose(v2, BETA2 ** 2 * v1 + (1 - BETA2 ** 2) * last ** 2)


def _reducer_with_adam(**options):
    param = torch.nn.Parameter(torch.zeros(4))
    reducer = A2SGDReducer([param], flush_errors_at_sync=True,
                           second_moment_from_exact_steps=True, **options)
    param.grad = torch.zeros(4)
    reducer.inner.rebind_all()
    adam = torch.optim.AdamW([param], lr=0.1, betas=(0.5, BETA2))
    reducer.attach(types.SimpleNamespace(loss_scale=1.0, optimizer=adam))
    return param, reducer, adam


def _reducer_step(reducer, param, adam, gradient):
    """One training step: (whether it was exact, the applied gradient, v after it)."""
    reducer.zero_grad()
    param.grad.copy_(torch.tensor(gradient))
    exact = reducer.exact_next_step
    reducer.wait()
    applied = param.grad.clone()
    adam.step()
    reducer.after_step(True)
    return exact, applied, adam.state[param]["exp_avg_sq"].clone()


def test_with_a_flush_interval_the_exponent_is_the_flush_interval_not_the_sync_interval():
    """--a2sgd-flush-interval 3, --a2sgd-sync-interval 5 (no sync in these 4 steps): steps 1 and
    4 are exact; step 4 stands for steps 2, 3 and 4, so its weight is 1 - beta2^3."""
    param, reducer, adam = _reducer_with_adam(sync_interval=5, flush_interval=3)
    gradients = [[1.0, -2.0, 0.5, 0.25], [3.0, -1.0, 1.0, -3.0], [2.0, 1.0, -1.0, -0.5],
                 [0.5, 4.0, -2.0, 1.0]]
    steps = [_reducer_step(reducer, param, adam, g) for g in gradients]
    assert [exact for exact, _, _ in steps] == [True, False, False, True]
    (_, first, v1), (_, last, v4) = steps[0], steps[3]
    assert torch.allclose(v1, (1 - BETA2) * first ** 2)
    assert torch.allclose(v4, BETA2 ** 3 * v1 + (1 - BETA2 ** 3) * last ** 2)


def test_the_count_since_the_last_exact_step_survives_a_checkpoint():
    param, reducer, adam = _reducer_with_adam(sync_interval=5, flush_interval=3)
    for gradient in ([1.0, -2.0, 0.5, 0.25], [3.0, -1.0, 1.0, -3.0]):  # exact, two-level
        _reducer_step(reducer, param, adam, gradient)
    state = reducer.state_dict()
    fresh_param, fresh, fresh_adam = _reducer_with_adam(sync_interval=5, flush_interval=3)
    fresh_param.data.copy_(param.data)
    fresh_adam.load_state_dict(adam.state_dict())
    fresh.load_state_dict(state)
    # a resume loads the optimizer after attach(): its new state is the one synced and kept
    assert fresh._optimizer_state() is fresh_adam.state
    v1 = fresh_adam.state[fresh_param]["exp_avg_sq"].clone()
    _reducer_step(fresh, fresh_param, fresh_adam, [2.0, 1.0, -1.0, -0.5])  # two-level
    exact, last, v4 = _reducer_step(fresh, fresh_param, fresh_adam, [0.5, 4.0, -2.0, 1.0])
    assert exact
    assert torch.allclose(v4, BETA2 ** 3 * v1 + (1 - BETA2 ** 3) * last ** 2)
    # a checkpoint written before the count was kept resumes with the old assumption: the last
    # exact step one sync interval before the next one (at most the steps taken)
    older = {key: value for key, value in state.items() if "second_moment" not in key}
    fresh.load_state_dict(older)
    assert fresh.second_moment.steps_since_exact == 2  # min(5 - 1, steps_done = 2)


def test_a_skipped_exact_step_is_retried_at_the_next_step():
    """A first step skipped (e.g. fp16's first loss scale overflows) must not leave the two-level
    steps with no exact second moment (v = 0 would make Adam's steps huge): the next step is
    exact and is Adam's first, v = (1 - beta2) g^2."""
    param, reducer, adam = _reducer_with_adam(sync_interval=5)
    reducer.zero_grad()
    param.grad.copy_(torch.tensor([1.0, -2.0, 0.5, 0.25]))
    reducer.wait()
    reducer.after_step(False)  # the optimizer skipped it
    assert reducer.exact_next_step
    exact, applied, v = _reducer_step(reducer, param, adam, [3.0, -1.0, 1.0, -3.0])
    assert exact and int(adam.state[param]["step"]) == 1
    assert torch.allclose(v, (1 - BETA2) * applied ** 2)
