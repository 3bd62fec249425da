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
gradient (``"accumulate"``: one of two fixed per-rank Gaussian patterns, alternating, so gradients
differ between ranks and steps without an extra pass over them per step; ``"fill"``: see below). The emulated steps of the benchmarks do not
update the parameters (an optimizer is compute, and on a CPU every pass over the model costs about
what the shared-memory all-reduce of it costs, which would cap communication / compute near 1);
:meth:`EmulatedModel.sgd_step` is there for callers that want one. Gradients arrive tensor by
tensor, last first, as in a real backward, so the post-accumulate hooks of an overlapping
all-reduce fire during the sleep.

Two ways to produce the gradient (``gradient_write``):

* ``"accumulate"`` (the default; ``benchmarks/a2sgd.py``): autograd accumulates the Gaussian
  patterns into ``.grad`` as a real backward does, so the reducers see realistic values, but a step
  costs the CPU passes over the gradient besides the sleep (the reducer's zeroing, autograd's
  accumulation and, in ``GradientReducer`` with ``divide_by`` = P, the division: 17-21 ms of CPU at
  10 M floats on our 2-core machine, 31 ms in ``torch.profiler`` under load). That is the floor of the
  emulated compute, and it runs on the cores a concurrent gloo all-reduce needs.
* ``"fill"`` (``benchmarks/crossover.py``): each tensor's sleeping backward *overwrites* its
  ``.grad`` with a constant (one per tensor, rank and step parity; :meth:`EmulatedModel.fill_values`),
  one write-only pass at memset speed and no zeroing (the floor: 6-10 ms of CPU per step at 10 M
  floats, the 40 MB write itself 5-6 ms). The all-reduce still moves and sums every
  byte of the real ``.grad`` buffers (its cost does not depend on the values). Use it with a
  reducer that sums (``divide_by=1``): the values stand for gradients already divided by the
  data-parallel size, so no division pass runs on the CPU either. No post-accumulate-grad hooks fire
  (the gradient does not go through autograd's accumulation), so it does not suit overlapping
  reducers.

Two ways to time the sleeps (``timeline``):

* ``"serial"`` (the default; ``benchmarks/a2sgd.py``): each sleep lasts its share from when it is
  called, so a step takes the sleeps *plus* everything the host does between them (the gradient
  writes, autograd, each sleep's wake-up latency), and whatever slows the host (another job's gloo
  threads holding the cores) lengthens the compute.
* ``"device"`` (``benchmarks/crossover.py``): the shares are laid out on a fixed timeline from the
  step's start, as an accelerator runs the kernels the host queued: the forward ends at
  ``start + forward_seconds`` and the k-th backward share ``k * share`` later; each sleep waits
  until its end, and tensor k's gradient is written once share k has ended (the device produced
  it). Host work and late wake-ups inside the step are absorbed while they fit in the next share;
  only what follows the last share (the last tensor's write, a wake-up) adds to the step. Every
  gradient byte is still written by the CPU each step, on the same cores as any concurrent
  all-reduce.

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


class _ComputeClock:
    """When one step's sleeps end (see ``timeline`` in the module docstring).

    ``"serial"``: each sleep lasts its share from whenever it is called, so a late wake-up or a slow
    gradient write before it moves every later one. ``"device"``: the shares are laid out on a fixed
    timeline from the step's start (the forward ends at ``start + forward_seconds``, the k-th
    backward share at ``start + forward_seconds + k * share``) and each sleep waits until its end,
    so host work and wake-up latency between them are absorbed while they fit in the next share.
    """

    def __init__(self, timeline: str, compute: ComputeTime, shares: int):
        self.timeline = timeline
        self.forward_seconds = compute.forward_seconds
        self.share = compute.backward_seconds / shares
        self.deadline = time.perf_counter()

    def _sleep(self, seconds: float) -> None:
        if self.timeline == "serial":
            if seconds > 0:
                time.sleep(seconds)
            return
        self.deadline += seconds
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def forward(self) -> None:
        self._sleep(self.forward_seconds)

    def backward_share(self) -> None:
        self._sleep(self.share)


class _SleepingGradient(torch.autograd.Function):
    """Forward: a zero scalar that depends on ``param``. Backward: sleep one share of ``clock``,
    then ``gradient``."""

    @staticmethod
    def forward(ctx, param, gradient, clock):
        ctx.gradient, ctx.clock = gradient, clock
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output):
        ctx.clock.backward_share()
        return ctx.gradient, None, None  # the loss is the sum: grad_output is 1


class _SleepingFill(torch.autograd.Function):
    """Forward: a zero scalar that depends on ``param``. Backward: sleep one share of ``clock``,
    then overwrite ``param.grad`` with ``value`` (one write-only pass); no gradient flows through
    autograd."""

    @staticmethod
    def forward(ctx, param, value, clock):
        ctx.param, ctx.value, ctx.clock = param, value, clock
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output):
        ctx.clock.backward_share()
        ctx.param.grad.fill_(ctx.value)
        return None, None, None


class EmulatedModel(torch.nn.Module):
    """``numel`` parameters in ``tensors`` tensors with sleeping compute (see the module docstring).

    Args:
        numel: parameters (and gradient entries) in all.
        tensors: how many tensors they are split into (the backward produces them one by one).
        seed: seeds this rank's gradient pattern (use a different one per rank).
        gradient_write: ``"accumulate"`` or ``"fill"`` (see the module docstring).
        timeline: ``"serial"`` or ``"device"``: how the sleeps are timed (see the module
            docstring).
    """

    GRADIENT_WRITES = ("accumulate", "fill")
    TIMELINES = ("serial", "device")

    def __init__(self, numel: int, tensors: int = 8, seed: int = 0,
                 gradient_write: str = "accumulate", timeline: str = "serial"):
        super().__init__()
        if numel < tensors:
            raise ValueError(f"{numel} parameters cannot fill {tensors} tensors; use fewer tensors")
        if gradient_write not in self.GRADIENT_WRITES:
            raise ValueError(f"gradient_write={gradient_write!r}: choose one of "
                             f"{', '.join(self.GRADIENT_WRITES)}")
        if timeline not in self.TIMELINES:
            raise ValueError(f"timeline={timeline!r}: choose one of {', '.join(self.TIMELINES)}")
        self.gradient_write, self.timeline = gradient_write, timeline
        sizes = [numel // tensors + (1 if index < numel % tensors else 0)
                 for index in range(tensors)]
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(size)) for size in sizes)
        if gradient_write == "fill":  # no per-entry patterns to hold
            self.patterns, self.odd_patterns = [], []
            self._fill_values = torch.randn(tensors, generator=generator)
            return
        self._fill_values = None
        self.patterns = [torch.randn(size, generator=generator) for size in sizes]
        # odd steps use a second, rescaled and shuffled pattern: gradients change between steps
        # without costing a pass over them per step
        self.odd_patterns = [-0.5 * pattern.roll(1) for pattern in self.patterns]

    @property
    def numel(self) -> int:
        return sum(weight.numel() for weight in self.weights)

    def gradients(self, step: int) -> list:
        """The gradient each tensor gets at ``step`` (``"accumulate"``): its pattern on even steps,
        the odd pattern (``-0.5`` times the pattern rolled by one) on odd steps."""
        if self.gradient_write != "accumulate":
            raise ValueError("gradients() are the accumulated patterns; this model fills "
                             "(gradient_write='fill'): use fill_values()")
        return self.odd_patterns if step % 2 else self.patterns

    def fill_values(self, step: int) -> list:
        """The constant each tensor's ``.grad`` is filled with at ``step`` (``"fill"``): one
        Gaussian draw per tensor on even steps, ``-0.5`` times them rolled by one on odd steps."""
        if self._fill_values is None:
            raise ValueError("fill_values() needs gradient_write='fill'")
        values = -0.5 * self._fill_values.roll(1) if step % 2 else self._fill_values
        return values.tolist()

    def forward_backward(self, compute: ComputeTime, step: int) -> None:
        """Sleep the forward, then backpropagate: each tensor sleeps its share of the backward and
        then produces its gradient: ``"accumulate"`` adds :meth:`gradients` into ``.grad``
        (autograd's accumulation, one pass); ``"fill"`` overwrites ``.grad`` with
        :meth:`fill_values` (a write-only pass; a missing ``.grad`` is allocated first). The
        sleeps follow the model's ``timeline``."""
        clock = _ComputeClock(self.timeline, compute, len(self.weights))
        clock.forward()
        if self.gradient_write == "fill":
            for weight in self.weights:
                if weight.grad is None:
                    weight.grad = torch.empty_like(weight)
            loss = sum(_SleepingFill.apply(weight, value, clock)
                       for weight, value in zip(self.weights, self.fill_values(step)))
        else:
            loss = sum(_SleepingGradient.apply(weight, gradient, clock)
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
