"""Emulated compute for data-parallel benchmarks: a model whose forward and backward *sleep*, with
real gradients of a chosen size and the real reducers and gloo collectives.

On a small CPU machine the communication of a data-parallel step runs on the same cores as the
compute, so neither A2SGD nor crossover scheduling can show what they save. Here a step's compute is
``time.sleep`` (a sleeping rank frees its core, as a rank waiting for its accelerator would), while
everything a reducer does (its flat buffers, the gradients autograd accumulates into them, its own
arithmetic: A2SGD's statistics, top-k selection, QSGD's quantisation; its collectives) is real.

:class:`EmulatedModel` holds ``numel`` float32 parameters in ``tensors`` equal tensors; its
:meth:`EmulatedModel.forward_backward` sleeps ``forward_seconds``, then runs a real backward
in which each tensor's backward sleeps its share of ``backward_seconds`` and returns that tensor's
gradient (one of two fixed per-rank Gaussian patterns, alternating, so gradients differ between
ranks and steps without a pass over them per step). The emulated steps of the benchmarks do not
update the parameters (an optimizer is compute, and on a CPU every pass over the model costs about
what the shared-memory all-reduce of it costs, which would cap communication / compute near 1);
:meth:`EmulatedModel.sgd_step` is there for callers that want one. Gradients arrive tensor by
tensor, last first, as in a real backward, so the post-accumulate hooks of an overlapping
all-reduce fire during the sleep.

Used by ``benchmarks/a2sgd.py --emulate-compute`` and ``benchmarks/crossover.py --emulate-compute``;
deliberately independent of the emulated pipeline stages of ``benchmarks/emulated_depth.py``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ComputeTime:
    """Seconds one step sleeps: a third in the forward, two thirds in the backward."""

    seconds: float

    @property
    def forward_seconds(self) -> float:
        return self.seconds / 3.0

    @property
    def backward_seconds(self) -> float:
        return self.seconds - self.forward_seconds


class _SleepingGradient(torch.autograd.Function):
    """Forward: a zero scalar that depends on ``param``. Backward: sleep, then ``gradient``."""

    @staticmethod
    def forward(ctx, param, gradient, backward_seconds):
        ctx.gradient, ctx.backward_seconds = gradient, backward_seconds
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.backward_seconds > 0:
            time.sleep(ctx.backward_seconds)
        return ctx.gradient, None, None  # the loss is the sum: grad_output is 1


class EmulatedModel(torch.nn.Module):
    """``numel`` parameters in ``tensors`` tensors with sleeping compute (see the module docstring).

    Args:
        numel: parameters (and gradient entries) in all.
        tensors: how many tensors they are split into (the backward produces them one by one).
        seed: seeds this rank's gradient pattern (use a different one per rank).
    """

    def __init__(self, numel: int, tensors: int = 8, seed: int = 0):
        super().__init__()
        if numel < tensors:
            raise ValueError(f"{numel} parameters cannot fill {tensors} tensors; use fewer tensors")
        sizes = [numel // tensors + (1 if index < numel % tensors else 0)
                 for index in range(tensors)]
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(size)) for size in sizes)
        self.patterns = [torch.randn(size, generator=generator) for size in sizes]
        # odd steps use a second, rescaled and shuffled pattern: gradients change between steps
        # without costing a pass over them per step
        self.odd_patterns = [-0.5 * pattern.roll(1) for pattern in self.patterns]

    @property
    def numel(self) -> int:
        return sum(weight.numel() for weight in self.weights)

    def gradients(self, step: int) -> list:
        """The gradient each tensor gets at ``step``: its pattern on even steps, the odd pattern
        (``-0.5`` times the pattern rolled by one) on odd steps."""
        return self.odd_patterns if step % 2 else self.patterns

    def forward_backward(self, compute: ComputeTime, step: int) -> None:
        """Sleep the forward, then backpropagate: each tensor sleeps its share of the backward and
        accumulates its gradient (:meth:`gradients`) into ``.grad``. Besides the sleep, the only
        work is autograd's accumulation (one pass over the gradient)."""
        if compute.forward_seconds > 0:
            time.sleep(compute.forward_seconds)
        share = compute.backward_seconds / len(self.weights)
        loss = sum(_SleepingGradient.apply(weight, gradient, share)
                   for weight, gradient in zip(self.weights, self.gradients(step)))
        loss.backward()

    @torch.no_grad()
    def sgd_step(self, lr: float = 1e-3) -> None:
        """The optimizer: plain SGD over every parameter (one pass over the model)."""
        for weight in self.weights:
            if weight.grad is not None:
                weight.add_(weight.grad, alpha=-lr)


def median_seconds(function: Callable[[], None], repeats: int, barrier: Callable[[], None]
                   ) -> float:
    """The median wall time of ``repeats`` calls of ``function``, each started after ``barrier()``
    (so every rank starts together)."""
    times = []
    for _ in range(repeats):
        barrier()
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def spread(values: list) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)
