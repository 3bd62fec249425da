"""Emulated pipeline stages for benchmarks/emulated_depth.py: sleeps instead of compute.

A stage's forward sleeps F, its backward sleeps I for the input gradient and W for the weight
gradient in two separate autograd nodes, so any split-backward runtime (ours and
torch.distributed.pipelining's ``stage_backward_input`` / ``stage_backward_weight``) really runs the
two halves apart. A sleeping rank frees its core, so 16 ranks fit on two cores. The modules carry a
real parameter of a configurable size per layer (all-reduced where a schedule has stage replicas,
updated by the optimizer), so a module of one layer holds half of what a module of two layers holds,
as in a real model; they send real activations of configurable size.

Stage graph (``out = input_path(h) + weight_path(h.detach(), weight)``): the input path's node is
the only one between the stage's input and its output, and the weight path hangs off the sum, so
the input half never touches the weight path and the weight half never the input path. On a first
stage ``h = x * gain`` (a one-element parameter), so its input path is needed for ``gain``: like a
real first stage (whose layers' input gradients lead to the embedding), its whole backward, I + W,
runs in the weight half.

Every op's sleep comes last and is shortened by the module's own work in that op (building the
graph, cloning, writing the gradient), measured from the op's start: F, I and W are whole ops, as a
measured profile times them, and the only time an op spends beyond its charge is the sleep's
wake-up. A whole backward (both halves in one autograd pass) is one op of I + W: its second half's
time counts from the first half's end (:class:`_BackwardClock`). (On this 2-core virtual machine
the first tensor operations after a sleep run 5-20x slower than warm ones, ~0.1 ms each, so work
done after the sleep cost 0.5-0.9 ms per op on both runtimes; docs/benchmarks.md §9, "Per-op
overhead, cut".)
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch


PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30  # linux/prctl.h


def set_timer_slack(nanoseconds: int) -> Optional[int]:
    """Set this thread's timer slack (Linux ``prctl(PR_SET_TIMERSLACK)``: how late the kernel may
    end a sleep to batch wake-ups; 50 µs by default) and return the previous value; threads and
    forked processes created afterwards inherit it. None (nothing changed) off Linux. The
    benchmarks call it before forking their ranks, so both runtimes' ranks sleep with it."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    previous = libc.prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if libc.prctl(PR_SET_TIMERSLACK, int(nanoseconds), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_TIMERSLACK, {nanoseconds}) failed")
    return previous


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline`` (at once if it has)."""
    time.sleep(max(0.0, deadline - time.perf_counter()))


def _graph_task() -> int:
    """The running backward pass (autograd's graph task id; -1 outside a backward)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


class _BackwardClock:
    """Shared by the two backward halves of one forward: when both run in one backward pass (a
    whole B, on either runtime), the second half's time is counted from the first half's end, so
    B is one op of I + W, as the plans charge it; halves run apart (split backward) start their
    own clocks. Without this, autograd's work between the two halves, after the first half's
    sleep, made every B overrun by a second wake-up."""

    def __init__(self):
        self.task = -2  # no half has run yet
        self.end = 0.0

    def deadline(self, seconds: float) -> float:
        task = _graph_task()
        start = self.end if task == self.task and task >= 0 else time.perf_counter()
        self.task, self.end = task, start + seconds
        return self.end


class _InputPath(torch.autograd.Function):
    """Identity; backward sleeps I (the module's forward sleeps F, after its graph is built)."""

    @staticmethod
    def forward(ctx, hidden, input_seconds, clock):
        ctx.input_seconds, ctx.clock = input_seconds, clock
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        deadline = ctx.clock.deadline(ctx.input_seconds)
        grad_input = grad.clone()
        sleep_until(deadline)
        return grad_input, None, None


class _WeightPath(torch.autograd.Function):
    """Zeros shaped like the hidden state; backward sleeps W and produces the weight's gradient.

    W is the whole weight-gradient op, as a measured profile would time it: writing the gradient
    and adding it to what ``weight.grad`` already holds count towards W's sleep. The backward
    therefore accumulates itself (``weight.grad`` is taken, the sum returned), so the runtime that
    called it (ours: split_backward.backward_weight or autograd's AccumulateGrad; PyTorch's
    stage_backward_weight) finds ``weight.grad`` empty and stores the returned tensor without
    another pass over the parameter's floats. The gradient values are the same either way.
    """

    @staticmethod
    def forward(ctx, hidden, weight, weight_seconds, clock):
        ctx.weight_seconds, ctx.clock = weight_seconds, clock
        ctx.save_for_backward(weight)
        return torch.zeros_like(hidden)

    @staticmethod
    def backward(ctx, grad):
        deadline = ctx.clock.deadline(ctx.weight_seconds)
        (weight,) = ctx.saved_tensors
        value = float(grad.mean()) * 1e-6
        accumulated, weight.grad = weight.grad, None
        # One pass over the weight's floats: add the value in place where a gradient is already
        # held, fill a new one where not (the same float32 values as filling then adding; the
        # two-pass form cost 2.1 ms of CPU per backward of 1 M floats, which at D = 16 crowded
        # the two cores in the W-only drain: docs/benchmarks.md §9, "The W phase at depth").
        # Writing (and accumulating) a large gradient takes time of its own: it counts towards W.
        weight_grad = (torch.full_like(weight, value) if accumulated is None
                       else accumulated.add_(value))
        sleep_until(deadline)
        return None, weight_grad, None, None


@dataclass(frozen=True)
class StageTimes:
    """Seconds of F, I and W per model layer, one entry per layer (the model has ``len(layers)``
    layers; a stage of several layers sleeps their sum)."""

    layers: tuple  # ((F, I, W), ...) per layer

    def of(self, layer_range) -> tuple[float, float, float]:
        totals = [0.0, 0.0, 0.0]
        for index in layer_range:
            for k in range(3):
                totals[k] += self.layers[index][k]
        return tuple(totals)

    def per_stage(self, num_stages: int) -> list[tuple[float, float, float]]:
        """(F, I, W) of each of ``num_stages`` equal consecutive layer ranges."""
        per = len(self.layers) // num_stages
        return [self.of(range(s * per, (s + 1) * per)) for s in range(num_stages)]


def uniform_times(depth: int, layers_per_stage: int, forward: float, input_half: float,
                  weight_half: float) -> StageTimes:
    """Every one of ``depth`` stages the same: F, I, W seconds per stage."""
    per = (forward / layers_per_stage, input_half / layers_per_stage,
           weight_half / layers_per_stage)
    return StageTimes(tuple(per for _ in range(depth * layers_per_stage)))


def profile_times(path: str, depth: int, layers_per_stage: int, input_share: float,
                  scale: float = 1.0) -> StageTimes:
    """Stage times from a profile JSON: ``{"stages": [[F, I, W], ...]}`` (seconds, one entry per
    stage of D), or ``tools/performance_model.py --measure`` output (its first compute record's
    forward_s / backward_s for every stage, the backward split ``input_share`` : 1 - share)."""
    with open(path) as handle:
        data = json.load(handle)
    if "stages" in data:
        stages = [tuple(float(v) * scale for v in entry) for entry in data["stages"]]
        if len(stages) != depth or any(len(entry) != 3 for entry in stages):
            raise ValueError(f"{path}: 'stages' needs {depth} entries [F, I, W] (one per stage "
                             f"of D = {depth}), got {len(stages)}")
    else:
        records = (data.get("measurements") or {}).get("compute") or []
        if not records:
            raise ValueError(f"{path} has neither 'stages' nor measurements.compute records; "
                             f"write it with tools/performance_model.py --measure")
        forward, backward = records[0]["forward_s"] * scale, records[0]["backward_s"] * scale
        stages = [(forward, backward * input_share, backward * (1 - input_share))] * depth
    layers = []
    for forward, input_half, weight_half in stages:
        layers += [(forward / layers_per_stage, input_half / layers_per_stage,
                    weight_half / layers_per_stage)] * layers_per_stage
    return StageTimes(tuple(layers))


def param_floats_per_layer(param_floats_per_stage: int, layers_per_stage: int) -> int:
    """The weight floats of one layer when a stage of ``layers_per_stage`` layers holds
    ``param_floats_per_stage`` (the benchmarks' ``--param-floats``)."""
    return max(1, param_floats_per_stage // layers_per_stage)


class EmulatedStage(torch.nn.Module):
    """The layers ``layer_range`` of the emulated model (see the module docstring). Implements
    our stage contract (``set_input_tensor``, ``input_activation_shape``) and plain
    ``forward(x)`` for torch.distributed.pipelining."""

    def __init__(self, times: StageTimes, layer_range, pre_process: bool, post_process: bool,
                 param_floats_per_layer: int, activation_floats: int):
        super().__init__()
        self.seconds = times.of(layer_range)
        self.pre_process, self.post_process = pre_process, post_process
        self.activation_floats = activation_floats
        # As in a real model, a module's weights grow with its layers: a chunk of one layer of an
        # interleaved or V schedule holds half of what a stage of two layers holds.
        self.weight = torch.nn.Parameter(
            torch.zeros(max(1, param_floats_per_layer * len(layer_range))))
        self.gain = torch.nn.Parameter(torch.ones(1)) if pre_process else None
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def input_activation_shape(self, microbatch: dict) -> tuple:
        return tuple(microbatch["x"].shape)

    def forward(self, x):
        forward, input_half, weight_half = self.seconds
        deadline = time.perf_counter() + forward  # the whole forward is F (module docstring)
        hidden = x if self.pre_process or self.input_tensor is None else self.input_tensor
        if self.pre_process:
            hidden = hidden * self.gain
        clock = _BackwardClock()
        output = (_InputPath.apply(hidden, input_half, clock)
                  + _WeightPath.apply(hidden.detach(), self.weight, weight_half, clock))
        sleep_until(deadline)
        return output


def emulated_loss(output, target=None):
    """The last stage's loss: cheap, so the last stage's F is the emulated one."""
    return output.float().pow(2).mean()
