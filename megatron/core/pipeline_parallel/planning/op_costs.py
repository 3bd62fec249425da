"""Per-stage compute charges of F, B, I and W, as the runtime spends them.

One table, shared by the split-backward planner and the simulator, so that a plan is placed with the
same charges it is simulated with. A stage's backward B splits into the input-gradient half I (the
message the previous stage waits for) and the weight-gradient half W. Two stages differ from the
rest (see :mod:`..execution.split_backward`):

* a **first stage** has no input gradient to send: its I is free (0) and its whole backward runs in
  the W half (B), so all of it can be deferred to an idle slot;
* a **last stage** also computes the loss: ``loss_cost`` is added to its forward.

Costs are per instruction micro-batch; :meth:`StageCosts.scaled` scales them for layouts whose
instruction micro-batch is a fraction of --micro-batch-size (backward halving). Per-stage values can
come from a measured profile (``per_stage``: stage -> (F, I, W), e.g. ``tools/performance_model.py
--measure`` output); stage indices are those of the schedule (virtual stages for interleaved
1F1B); all pipelines of a schedule hold the same stages, so pipelines share the entry.

What a run spends besides compute, where known (both 0 by default: the free-message plan):

* ``op_overhead`` (oF, oI, oW): added to every F, I and W op (a whole B: oI + oW; a first stage's
  free I: nothing), e.g. the runtime's per-op Python work and a sleeping stage's wake-up;
* ``message_latency`` δ: what a message between ranks costs on the critical path. The table only
  carries it to the planner (a split-backward plan is then placed latency-tolerant, see
  :mod:`.schedules.split_backward`); the simulator charges messages through its ``p2p_cost``.

No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from .instructions import Instruction, Kind


@dataclass(frozen=True)
class StageCosts:
    """Compute charge of every instruction of a schedule with ``num_stages`` stages per pipeline.

    Attributes:
        num_stages: stages per pipeline.
        forward: F of a stage without its own entry in ``per_stage``.
        backward: B = I + W of such a stage.
        input_share: I / B of such a stage (0.5: the two halves equal).
        loss_cost: added to the last stage's forward.
        per_stage: stage -> (F, I, W) where measured; a first stage's I is still charged as W.
        uniform_split: charge a first stage's halves like every other stage's (I = input_share * B):
            the planner's former model, kept only to compare with.
        op_overhead: (oF, oI, oW) added per op (see the module docstring).
        message_latency: δ per message between ranks, for the planner (module docstring).
    """

    num_stages: int
    forward: float = 1.0
    backward: float = 2.0
    input_share: float = 0.5
    loss_cost: float = 0.0
    per_stage: Mapping[int, tuple] = field(default_factory=dict)
    uniform_split: bool = False
    op_overhead: tuple = (0.0, 0.0, 0.0)
    message_latency: float = 0.0

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"stage costs need at least one stage, got {self.num_stages}")
        if not 0.0 <= self.input_share <= 1.0:
            raise ValueError(f"input_share is I / B and must lie in [0, 1], got "
                             f"{self.input_share}")
        negative = [value for value in (self.forward, self.backward, self.loss_cost)
                    if value < 0]
        for stage, values in self.per_stage.items():
            if not 0 <= stage < self.num_stages or len(values) != 3:
                raise ValueError(f"per-stage costs need stage -> (F, I, W) for a stage in "
                                 f"0..{self.num_stages - 1}; got {stage} -> {values}")
            negative += [value for value in values if value < 0]
        if negative:
            raise ValueError(f"compute costs must be >= 0, got {negative[0]}")
        if len(self.op_overhead) != 3 or min(self.op_overhead) < 0:
            raise ValueError(f"op_overhead must be three per-op overheads (F, I, W) >= 0, got "
                             f"{self.op_overhead}")
        if self.message_latency < 0:
            raise ValueError(f"message_latency must be >= 0, got {self.message_latency}")

    @property
    def charges_overhead(self) -> bool:
        """Whether anything besides compute is known (overhead or message latency)."""
        return self.message_latency > 0 or any(value > 0 for value in self.op_overhead)

    def forward_input_weight(self, stage: int) -> tuple[float, float, float]:
        """(F, I, W) of ``stage`` as the runtime spends them (first stage: I = 0, W = B)."""
        if stage in self.per_stage:
            forward, input_half, weight_half = (float(v) for v in self.per_stage[stage])
        else:
            input_half = self.backward * self.input_share
            forward, weight_half = self.forward, self.backward - input_half
        if stage == self.num_stages - 1:
            forward += self.loss_cost
        if stage == 0 and not self.uniform_split:
            input_half, weight_half = 0.0, input_half + weight_half
        return forward, input_half, weight_half

    def cost(self, op: Instruction) -> float:
        """Charge of one compute instruction (its compute plus its op overhead)."""
        forward, input_half, weight_half = self.forward_input_weight(op.stage)
        over_forward, over_input, over_weight = self.op_overhead
        if op.kind is Kind.FORWARD:
            return forward + over_forward
        if op.kind is Kind.BACKWARD:
            return input_half + weight_half + over_input + over_weight
        if op.kind is Kind.BACKWARD_INPUT:
            return input_half + (over_input if input_half > 0 else 0.0)
        return weight_half + over_weight

    def with_overheads(self, op_overhead=(0.0, 0.0, 0.0),
                       message_latency: float = 0.0) -> "StageCosts":
        """The same compute charges with these per-op overheads and message latency."""
        return replace(self, op_overhead=tuple(float(v) for v in op_overhead),
                       message_latency=float(message_latency))

    def scaled(self, fraction: float) -> "StageCosts":
        """The same table with every compute cost times ``fraction`` (instruction micro-batch
        size); overheads and latency are per op and per message, unscaled."""
        if fraction == 1:
            return self
        per_stage = {stage: tuple(v * fraction for v in values)
                     for stage, values in self.per_stage.items()}
        return StageCosts(self.num_stages, self.forward * fraction, self.backward * fraction,
                          self.input_share, self.loss_cost * fraction, per_stage,
                          self.uniform_split, self.op_overhead, self.message_latency)

    def ideal_compute(self, num_pipelines: int = 1, microbatches: Optional[int] = None) -> float:
        """Compute time of all stages for ``microbatches`` instruction micro-batches per pipeline
        (summed over the stages of one pipeline; the schedule's lower bound times the ranks)."""
        count = 1 if microbatches is None else microbatches
        return count * num_pipelines * sum(sum(self.forward_input_weight(stage))
                                           for stage in range(self.num_stages))


def uniform_stage_costs(num_stages: int, forward_cost: float = 1.0,
                        backward_cost: float = 2.0) -> StageCosts:
    """The default table: every stage F and B = 2 halves, first stage I = 0 and W = B."""
    return StageCosts(num_stages, float(forward_cost), float(backward_cost))
