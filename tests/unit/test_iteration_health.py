"""Stop rules applied after every iteration: NaN check and the bound on consecutive skips."""

import math
from types import SimpleNamespace

import pytest

from megatron.training.iteration_health import IterationHealth, TrainingDivergedError


def _record(iteration, loss=1.0, grad_norm=1.0, skipped=False):
    return SimpleNamespace(iteration=iteration, losses={"lm loss": loss}, grad_norm=grad_norm,
                           skipped=skipped, got_nan=not math.isfinite(loss), loss_scale=1.0)


def _health(check_for_nan=False, limit=100, rank=3):
    config = SimpleNamespace(training=SimpleNamespace(
        check_for_nan_in_loss_and_grad=check_for_nan, max_consecutive_skipped_iterations=limit))
    return IterationHealth.from_config(config, rank)


@pytest.mark.parametrize("loss,grad_norm", [(math.nan, 1.0), (1.0, math.inf), (1.0, math.nan)])
def test_nan_check_names_iteration_and_rank(loss, grad_norm):
    _health().check(_record(7, loss, grad_norm, skipped=True))  # off: no stop
    with pytest.raises(TrainingDivergedError, match="rank 3: iteration 7: found NaN or inf"):
        _health(check_for_nan=True).check(_record(7, loss, grad_norm, skipped=True))


def test_consecutive_skips_stop_and_a_good_step_resets():
    health = _health(limit=3)
    for iteration, skipped in enumerate([True, True, False, True, True], start=1):
        health.check(_record(iteration, skipped=skipped))
    with pytest.raises(TrainingDivergedError, match="last 3 iterations all skipped"):
        health.check(_record(6, skipped=True))
    disabled = _health(limit=0)
    for iteration in range(1, 200):
        disabled.check(_record(iteration, skipped=True))
    with pytest.raises(ValueError, match="must be >= 0"):
        _health(limit=-1)
