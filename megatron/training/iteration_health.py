"""Stop a run that cannot make progress instead of letting it save and exit 0.

Two rules, applied after every iteration by :class:`IterationHealth` (the loop owns one instance):

- ``--check-for-nan-in-loss-and-grad`` (Megatron's flag): a NaN or infinite loss or gradient norm
  ends the run with an error naming the iteration and the rank. The loss and the norm are reduced
  over all ranks, so every rank sees the same values and stops at the same iteration.
- ``--max-consecutive-skipped-iterations N`` (default 100, 0 disables): N skipped updates in a row
  (overflow that the loss scaler did not cure, or non-finite gradients in fp32/bf16, where no scale
  can help) end the run. The fp16 loss scaler normally recovers within a few dozen halvings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class TrainingDivergedError(RuntimeError):
    """Training cannot continue (NaN/inf, or updates skipped for too long)."""


@dataclass
class IterationHealth:
    """Counts consecutive skipped updates and applies the stop rules to each iteration's record."""

    check_for_nan: bool
    max_consecutive_skipped: int
    rank: int
    consecutive_skipped: int = 0

    @classmethod
    def from_config(cls, config, rank: int) -> "IterationHealth":
        limit = config.training.max_consecutive_skipped_iterations
        if limit < 0:
            raise ValueError(f"--max-consecutive-skipped-iterations {limit} must be >= 0 (0 "
                             f"disables the limit)")
        return cls(check_for_nan=config.training.check_for_nan_in_loss_and_grad,
                   max_consecutive_skipped=limit, rank=rank)

    def check(self, record) -> None:
        """Raise TrainingDivergedError if ``record`` (an IterationRecord) breaks a rule."""
        if self.check_for_nan and _not_finite(record):
            raise TrainingDivergedError(
                f"rank {self.rank}: iteration {record.iteration}: found NaN or inf in the loss "
                f"({_format_losses(record.losses)}) or gradient norm ({record.grad_norm}) "
                f"(--check-for-nan-in-loss-and-grad); lower the learning rate or "
                f"--init-method-std, or resume from an earlier checkpoint")
        self.consecutive_skipped = self.consecutive_skipped + 1 if record.skipped else 0
        if self.max_consecutive_skipped and self.consecutive_skipped >= self.max_consecutive_skipped:
            raise TrainingDivergedError(
                f"rank {self.rank}: iteration {record.iteration}: the last "
                f"{self.consecutive_skipped} iterations all skipped their update (non-finite "
                f"gradients; loss scale {record.loss_scale}); the run is not training. Lower the "
                f"learning rate or --init-method-std, or raise "
                f"--max-consecutive-skipped-iterations (0 disables this check)")


def _not_finite(record) -> bool:
    if record.got_nan:
        return True
    return record.grad_norm is not None and not math.isfinite(record.grad_norm)


def _format_losses(losses: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in losses.items())
