"""Megatron's per-bucket gradient checks: the norm of each bucket of a rank's own gradients, taken
just before the data-parallel reduction sends it.

Megatron-LM validates every gradient bucket before its collective (NaN and Inf with
``--check-for-nan-in-loss-and-grad``, "unexpected large grads" with ``--check-for-large-grads``),
so a fault is pinned to the rank whose backward produced it, before the reduction spreads it to
every replica. :class:`LocalGradientNorms` records those norms through the reductions'
``watch_local_gradients`` seam (:mod:`megatron.core.distributed.reduction`); the checks themselves
are the re-run engine's (:mod:`megatron.training.rerun`). Recording reads the gradients only: the
losses and updates are the same with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from megatron.training.rerun import (LocalResults, ResultValidator, gradient_checks,
                                     validate_without_rerun)


@dataclass
class LocalGradientNorms:
    """The L2 norm of every gradient bucket this rank's reductions sent in the current run of an
    iteration, in the order they sent them (computed in float32, float64 buckets in float64).
    ``validator``: the checks to apply when no re-run engine does (``--rerun-mode disabled``),
    else None."""

    norms: list = field(default_factory=list)
    validator: Optional[ResultValidator] = None

    def observe(self, gradients: torch.Tensor) -> None:
        gradients = gradients.detach()
        # at least float32 (fp16/bf16 buckets are widened; float64 ones cannot be narrowed)
        wider = torch.float32 if gradients.element_size() < 4 else None
        self.norms.append(float(torch.linalg.vector_norm(gradients, dtype=wider)))

    def watch(self, reducers: Iterable) -> "LocalGradientNorms":
        """Record the buckets of ``reducers`` (each a GradientReduction) from now on."""
        for reducer in reducers:
            reducer.watch_local_gradients(self.observe)
        return self

    def clear(self) -> None:
        """Forget the last run's norms (at the start of every run of an iteration)."""
        self.norms = []

    def results(self, losses=()) -> LocalResults:
        return LocalResults(losses=tuple(losses), grad_norms=tuple(self.norms))

    def validate_alone(self, rank: int, iteration: int) -> None:
        """Without the re-run engine: apply ``validator`` to the recorded norms (raises on a fatal
        rejection, logs a large norm)."""
        if self.validator is not None:
            validate_without_rerun(self.validator, self.results(), rank, iteration)


def gradient_norms_for(training, reducers: Iterable) -> Optional[LocalGradientNorms]:
    """A recorder watching ``reducers`` when the flags (``config.training``) ask for a gradient
    check, else None (nothing is computed). Without the re-run engine it validates by itself."""
    checks = gradient_checks(training)
    if not checks:
        return None
    alone = ResultValidator(checks) if training.rerun_mode == "disabled" else None
    return LocalGradientNorms(validator=alone).watch(reducers)
