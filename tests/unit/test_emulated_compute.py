"""The emulated data-parallel compute of benchmarks/_emulated_compute.py: it sleeps what it is told
and produces real gradients, tensor by tensor, into whatever ``.grad`` buffers a reducer set up."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from _emulated_compute import ComputeTime, EmulatedModel  # noqa: E402
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
