"""The progress counters of a training run, which a checkpoint must restore to resume exactly.

Their own module, so that the checkpointer (which restores them) and the training loop (which
advances them) both import it and neither has to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainingState:
    """Progress that a checkpoint must restore to resume exactly."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    # This rank's pending re-run (megatron.training.rerun, exit 16): set only while the engine's
    # checkpoint is saved, and when such a checkpoint is loaded; None otherwise.
    rerun_state: Optional[dict] = None
