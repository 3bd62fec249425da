"""``--exit-signal-handler``: a SIGTERM (SLURM preemption, ``#SBATCH --signal``, ``scancel``, or
torchrun forwarding its own SIGTERM) is recorded, and the training loop saves at the end of the
current iteration on every rank and exits normally (the ranks agree through one all-reduce per
iteration, see :func:`megatron.training.training.train`)."""

from __future__ import annotations

import signal
import threading


class ExitSignalHandler:
    """Records that ``signum`` arrived; installed for the duration of a ``with`` block (only in
    the main thread, where Python delivers signals) and restores the previous handler after."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> "ExitSignalHandler":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
