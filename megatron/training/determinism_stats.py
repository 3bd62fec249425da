"""``--rerun-mode report_stats`` (Megatron-LM's determinism report): every iteration runs twice from
the same state, and the relative difference between the two runs at each validation (each local
loss; each gradient bucket's local norm when a gradient check is on) is recorded per validation
message. Every ``REPORTING_INTERVAL`` iterations global rank 0 gathers every rank's samples and
logs one line per message in Megatron's format::

    Stats on computation determinism in validation calls
      found NaN in local forward loss calculation: 16/16 total/identical samples, ...

A line reads ``total/identical samples, rel. variability: avg= ..., p50= ..., p90= ..., p99= ...,
p99.9= ..., max: ...`` (identical samples count as 0 in the average and the percentiles) or, when
every sample was identical, ``N samples, all identical``. Rank 0 keeps accumulating; the other
ranks hand their samples over at each report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

REPORTING_INTERVAL = 2  # iterations between reports (Megatron's REPORTING_INTERVAL_ITERATIONS)
MAX_SAMPLES = 100_000   # non-zero differences kept per message


@dataclass
class DeterminismStats:
    """The distribution of one validation's relative differences between a run and its re-run."""

    samples: list = field(default_factory=list)  # the non-zero differences (at most MAX_SAMPLES)
    identical: int = 0
    largest: float = 0.0

    def record(self, difference: float) -> None:
        if difference == 0.0:
            self.identical += 1
            return
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(difference)
        self.largest = max(self.largest, difference)

    def absorb(self, other: "DeterminismStats") -> None:
        self.samples.extend(other.samples[:max(0, MAX_SAMPLES - len(self.samples))])
        self.identical += other.identical
        self.largest = max(self.largest, other.largest)

    def summary(self) -> str:
        if not self.samples:
            return f"{self.identical:,} samples, all identical"
        ordered = sorted(self.samples)
        total = self.identical + len(ordered)

        def percentile(p: float) -> str:
            index = int(total * p) - self.identical
            return f"{ordered[min(index, len(ordered) - 1)]:.3E}" if index >= 0 else "0.0"
        return (f"{total:,}/{self.identical:,} total/identical samples, rel. variability: "
                f"avg= {sum(ordered) / total:.3E}, p50= {percentile(0.5)}, "
                f"p90= {percentile(0.9)}, p99= {percentile(0.99)}, p99.9= {percentile(0.999)}, "
                f"max: {self.largest:.3E}")


def gather_to_first_rank(stats: dict) -> Optional[list]:
    """Every rank's ``{message: DeterminismStats}`` on global rank 0 (None on the others); one
    process: ``[stats]``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [stats]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(stats, gathered, dst=0)
    return gathered


@dataclass
class DeterminismReport:
    """The samples of this rank and, on rank 0, the report (see the module docstring)."""

    log: Callable[[str], None]
    gather: Callable[[dict], Optional[list]] = gather_to_first_rank
    stats: dict = field(default_factory=dict)  # message -> DeterminismStats

    def record(self, message: str, difference: float) -> None:
        self.stats.setdefault(message, DeterminismStats()).record(difference)

    def report_if_due(self, iteration: int) -> None:
        """Collective every REPORTING_INTERVAL iterations (every rank calls it each iteration)."""
        if iteration % REPORTING_INTERVAL:
            return
        gathered = self.gather(self.stats)
        if gathered is None:  # not rank 0: rank 0 has the samples now
            self.stats = {}
            return
        for other in gathered[1:]:
            for message, stats in other.items():
                self.stats.setdefault(message, DeterminismStats()).absorb(stats)
        self.log("Stats on computation determinism in validation calls")
        for message in sorted(self.stats):
            self.log(f"  {message}: {self.stats[message].summary()}")
