"""The emulated data-parallel compute of benchmarks/_emulated_compute.py: it sleeps what it is told
and produces real gradients, tensor by tensor, into whatever ``.grad`` buffers a reducer set up."""

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from _emulated_compute import ComputeTime, EmulatedModel, _ComputeClock  # noqa: E402
from megatron.core.distributed.gradient_reducer import GradientReducer  # noqa: E402


def test_gradients_are_the_pattern_times_the_step_factor_and_land_in_the_reducer_buffer():
    model = EmulatedModel(10, tensors=3, seed=5)
    assert [w.numel() for w in model.weights] == [4, 3, 3] and model.numel == 10
    reducer = GradientReducer(model.parameters())
    reducer.zero_grad()
    model.forward_backward(ComputeTime(0.0), step=2)
    for weight, pattern in zip(model.weights, model.patterns):
        torch.testing.assert_close(weight.grad, pattern)
    reducer.zero_grad()
    model.forward_backward(ComputeTime(0.0), step=3)
    for weight, pattern in zip(model.weights, model.patterns):
        torch.testing.assert_close(weight.grad, -0.5 * pattern.roll(1))
    flat = next(iter(reducer.buffers.values()))
    assert flat.abs().sum() > 0  # autograd accumulated into the reducer's flat buffer
    other = EmulatedModel(10, tensors=3, seed=6)
    assert not torch.equal(other.patterns[0], model.patterns[0])  # ranks differ


def test_it_sleeps_the_compute_and_the_backward_delivers_tensor_by_tensor():
    model = EmulatedModel(6, tensors=3)
    arrivals = []
    for index, weight in enumerate(model.weights):
        weight.register_post_accumulate_grad_hook(
            lambda _, index=index: arrivals.append((index, time.perf_counter())))
    started = time.perf_counter()
    model.forward_backward(ComputeTime(0.3), step=0)
    assert time.perf_counter() - started >= 0.3
    assert sorted(index for index, _ in arrivals) == [0, 1, 2]
    times = sorted(t for _, t in arrivals)
    assert times[-1] - times[0] >= 2 * 0.2 / 3 * 0.9  # spaced by the backward's shares


def test_sgd_step_moves_against_the_gradient():
    model = EmulatedModel(4, tensors=1)
    model.forward_backward(ComputeTime(0.0), step=0)
    model.sgd_step(lr=0.5)
    torch.testing.assert_close(model.weights[0].detach(), -0.5 * model.patterns[0])


def test_fill_overwrites_the_reducer_buffer_with_one_constant_per_tensor_without_zeroing():
    model = EmulatedModel(10, tensors=3, seed=5, gradient_write="fill")
    reducer = GradientReducer(model.parameters())
    flat = next(iter(reducer.buffers.values()))
    flat.fill_(123.0)  # stale values: the fill must overwrite, not accumulate
    model.forward_backward(ComputeTime(0.0), step=2)
    even = model.fill_values(2)
    for weight, value in zip(model.weights, even):
        torch.testing.assert_close(weight.grad, torch.full_like(weight, value))
    assert len(set(even)) == 3 and weight.grad.data_ptr() >= flat.data_ptr()
    model.forward_backward(ComputeTime(0.0), step=3)
    odd = [-0.5 * value for value in even[-1:] + even[:-1]]
    for weight, value in zip(model.weights, odd):
        torch.testing.assert_close(weight.grad, torch.full_like(weight, value))
    assert model.fill_values(3) == pytest.approx(odd)
    assert float(flat.sum()) == pytest.approx(sum(v * w.numel() for v, w in zip(odd, model.weights)))
    other = EmulatedModel(10, tensors=3, seed=6, gradient_write="fill")
    assert other.fill_values(2) != even  # ranks differ


def test_fill_sleeps_the_compute_and_allocates_a_missing_grad():
    model = EmulatedModel(6, tensors=3, gradient_write="fill")
    started = time.perf_counter()
    model.forward_backward(ComputeTime(0.3), step=0)
    assert time.perf_counter() - started >= 0.3
    for weight, value in zip(model.weights, model.fill_values(0)):
        torch.testing.assert_close(weight.grad, torch.full_like(weight, value))


def test_gradient_write_mistakes_name_the_fix():
    with pytest.raises(ValueError, match="accumulate, fill"):
        EmulatedModel(6, tensors=3, gradient_write="copy")
    with pytest.raises(ValueError, match="fill_values"):
        EmulatedModel(6, tensors=3, gradient_write="fill").gradients(0)
    with pytest.raises(ValueError, match="gradient_write='fill'"):
        EmulatedModel(6, tensors=3).fill_values(0)


@pytest.mark.parametrize("gradient_write", ["accumulate", "fill"])
def test_the_device_timeline_absorbs_host_work_between_shares_and_the_serial_one_adds_it(
        gradient_write, monkeypatch):
    """Host work before the 2nd and 3rd backward shares (0.1 s each, less than a 0.133 s share)
    lengthens a serial step by 0.2 s and a device-timeline step not at all; every gradient is
    still written."""
    backward_share = _ComputeClock.backward_share
    elapsed = {}
    for timeline in EmulatedModel.TIMELINES:
        model = EmulatedModel(6, tensors=3, gradient_write=gradient_write, timeline=timeline)
        shares = []

        def slow_share(clock, shares=shares):
            if shares:
                time.sleep(0.1)  # the host busy between two shares
            shares.append(time.perf_counter())
            backward_share(clock)
        monkeypatch.setattr(_ComputeClock, "backward_share", slow_share)
        started = time.perf_counter()
        model.forward_backward(ComputeTime(0.6), step=0)
        elapsed[timeline] = time.perf_counter() - started
        assert len(shares) == 3 and all(weight.grad is not None for weight in model.weights)
    assert elapsed["serial"] >= 0.6 + 0.2, elapsed
    assert 0.6 <= elapsed["device"] < 0.6 + 0.15, elapsed


def test_an_unknown_timeline_names_the_choices():
    with pytest.raises(ValueError, match="serial, device"):
        EmulatedModel(6, tensors=3, timeline="wall")


def test_the_finite_run_ceiling_exposes_one_min_c_m_and_tends_to_the_bound():
    from crossover import finite_run_ceiling
    assert finite_run_ceiling(1.0, 1.0, 8) == pytest.approx(32 / 17)  # 94% of the bound 2
    assert finite_run_ceiling(2.0, 1.0, 8) == pytest.approx(48 / 33)  # M < C: the last M exposed
    assert finite_run_ceiling(1.0, 2.0, 8) == pytest.approx(48 / 33)  # M > C: the first C exposed
    assert finite_run_ceiling(1.0, 1.0, 10_000) == pytest.approx(2.0, rel=1e-4)
