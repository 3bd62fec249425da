"""``--a2sgd-sync-flushes-errors``: a sync makes the next step exact, so every rank's unapplied
error reaches the optimizer (one process here; the data-parallel version is in
tests/distributed/test_a2sgd_flush_dp.py)."""

import pytest
import torch

from megatron.core.distributed.a2sgd import A2SGD_REDUCER, A2SGDReducer
from megatron.core.distributed.reducers import build_gradient_reducers
from megatron.core.distributed.reduction import load_reducer_states, reducer_states
from megatron.training.arguments import parse_args

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 5 "
        "--mock-data --dp-gradient-reducer a2sgd").split()


def _step(reducer, param, gradient, counted: bool = False):
    """One step; ``counted``: end it with the training loop's ``after_step`` (which also counts
    steps for ``flush_interval``) instead of ``finish_step``."""
    reducer.zero_grad()
    param.grad.copy_(torch.tensor(gradient))
    reducer.wait()
    applied = param.grad.tolist()
    (reducer.after_step if counted else reducer.finish_step)(True)
    return applied, reducer.errors[torch.float32].tolist()


def _reducer(flush: bool):
    param = torch.nn.Parameter(torch.zeros(4))
    reducer = A2SGDReducer([param], flush_errors_at_sync=flush)
    param.grad = torch.zeros(4)
    reducer.inner.rebind_all()
    return param, reducer


def test_the_step_after_a_flushing_sync_applies_gradient_plus_error():
    param, reducer = _reducer(flush=True)
    # step 1: two means (3 + 1) / 2 and (-1 - 3) / 2; error [1, 1, -1, -1]
    assert _step(reducer, param, [3.0, -1.0, 1.0, -3.0]) == ([2.0, -2.0, 2.0, -2.0],
                                                              [1.0, 1.0, -1.0, -1.0])
    reducer.synchronize()
    assert reducer.exact_next_step
    # step 2 is exact: p = g + e applied as it is, no error left
    assert _step(reducer, param, [0.5, 0.0, 0.0, 0.0]) == ([1.5, 1.0, -1.0, -1.0],
                                                            [0.0, 0.0, 0.0, 0.0])
    assert not reducer.exact_next_step
    # step 3 is two-level again: means (2 + 1) / 2 = 1.5 and -1
    assert _step(reducer, param, [2.0, 1.0, -1.0, -1.0])[0] == [1.5, 1.5, -1.0, -1.0]


def test_without_the_flag_the_step_after_a_sync_stays_two_level():
    param, reducer = _reducer(flush=False)
    _step(reducer, param, [3.0, -1.0, 1.0, -3.0])
    reducer.synchronize()
    applied, error = _step(reducer, param, [0.5, 0.0, 0.0, 0.0])  # p = [1.5, 1, -1, -1]
    assert applied == [1.25, 1.25, -1.0, -1.0]
    assert error == [0.25, -0.25, 0.0, 0.0]


def test_the_loss_scale_is_removed_and_restored_on_the_exact_step():
    param, reducer = _reducer(flush=True)
    reducer.loss_scale = lambda: 4.0
    _step(reducer, param, [12.0, -4.0, 4.0, -12.0])  # unscaled [3, -1, 1, -3]
    reducer.synchronize()
    applied, error = _step(reducer, param, [2.0, 0.0, 0.0, 0.0])  # unscaled p [1.5, 1, -1, -1]
    assert applied == [6.0, 4.0, -4.0, -4.0]
    assert error == [0.0] * 4


def test_a_pending_exact_step_survives_a_checkpoint():
    param, reducer = _reducer(flush=True)
    _step(reducer, param, [3.0, -1.0, 1.0, -3.0])
    reducer.synchronize()  # the checkpointer syncs, then saves
    states = [reducer_states([reducer])]
    fresh_param, fresh = _reducer(flush=True)
    load_reducer_states([fresh], states, dp_rank=0)
    assert fresh.exact_next_step
    assert _step(fresh, fresh_param, [0.5, 0.0, 0.0, 0.0])[0] == [1.5, 1.0, -1.0, -1.0]
    older = [[{"errors": states[0][0]["errors"]}]]  # a checkpoint written before the flag
    load_reducer_states([fresh], older, dp_rank=0)
    assert not fresh.exact_next_step


def _flag_reducer(argv) -> A2SGDReducer:
    config = parse_args(TINY + argv, world_size=1)
    chunks = [torch.nn.Sequential(torch.nn.Linear(4, 3))]
    reducers = build_gradient_reducers(chunks, [0], lambda key: None, 1.0, kind=A2SGD_REDUCER,
                                       parallel=config.parallel)
    return reducers.by_module[0]


def test_the_flag_reaches_the_reducer_and_is_off_by_default():
    assert not _flag_reducer([]).flush_errors_at_sync
    assert _flag_reducer(["--a2sgd-sync-flushes-errors"]).flush_errors_at_sync


def test_the_periodic_sync_flag_reaches_the_reducer():
    assert _flag_reducer([]).periodic_sync_averages_optimizer
    assert not _flag_reducer(["--a2sgd-periodic-sync", "parameters"]).periodic_sync_averages_optimizer
    with pytest.raises(SystemExit):
        _flag_reducer(["--a2sgd-periodic-sync", "moments"])


def test_a_flush_interval_makes_every_nth_next_step_exact_without_a_sync():
    param = torch.nn.Parameter(torch.zeros(4))
    reducer = A2SGDReducer([param], flush_interval=2)
    param.grad = torch.zeros(4)
    reducer.inner.rebind_all()
    exact_steps = []
    for _ in range(6):
        exact = reducer.exact_next_step
        applied, error = _step(reducer, param, [3.0, -1.0, 1.0, -3.0], counted=True)
        exact_steps.append(exact)
        if exact:  # p = g + e applied as it is, no error left
            assert error == [0.0] * 4
        else:
            assert sorted(set(applied)) != sorted(set([3.0, -1.0, 1.0, -3.0]))
    assert exact_steps == [False, False, True, False, True, False]
    # the step count survives a checkpoint (the phase of the interval)
    assert reducer.state_dict()["steps_done"] == 6
    fresh = A2SGDReducer([torch.nn.Parameter(torch.zeros(4))], flush_interval=2)
    fresh.load_state_dict(reducer.state_dict())
    assert fresh.steps_done == 6


def test_the_flush_interval_flag_reaches_the_reducer_and_is_checked():
    assert _flag_reducer([]).flush_interval == 0
    assert _flag_reducer(["--a2sgd-flush-interval", "2"]).flush_interval == 2
    with pytest.raises(ValueError, match="--a2sgd-flush-interval"):
        _flag_reducer(["--a2sgd-flush-interval", "-1"])
