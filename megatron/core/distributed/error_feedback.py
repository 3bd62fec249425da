"""Error feedback shared by the compressing reducers (A2SGD, top-k): per dtype, what compression
left out of the applied gradient, added back to the next step's gradient.

An iteration stages the new errors while it reduces; they replace the kept ones only when the
optimizer really stepped (an fp16 overflow step drops them, so a skipped step changes nothing).
The errors are checkpointed with the reducer (``state_dict``), in the reducer's flat layout.
"""

from __future__ import annotations

from typing import Optional

import torch


class ErrorFeedback:
    """The kept error buffers (``errors``: dtype -> flat tensor) and the ones staged this step."""

    def __init__(self, errors: dict, reducer_name: str):
        self.errors = errors
        self.reducer_name = reducer_name
        self._staged: Optional[dict] = None

    def stage(self, dtype: torch.dtype, error: torch.Tensor) -> None:
        """Keep ``error`` for ``dtype`` once :meth:`commit` confirms the step."""
        if self._staged is None:
            self._staged = {}
        self._staged[dtype] = error

    def commit(self, update_successful: bool) -> None:
        """Adopt the staged errors when the optimizer stepped; drop them on an overflow step."""
        if self._staged is not None and update_successful:
            for dtype, error in self._staged.items():
                self.errors[dtype].copy_(error)
        self._staged = None

    def adopt_staged(self, update_successful: bool) -> dict:
        """Like :meth:`commit`, but the staged tensors *become* the kept errors (no copy); returns
        the replaced tensors by dtype (empty when nothing was adopted), free for the caller to
        reuse as work buffers. Only for a caller that staged tensors it owns and will not touch
        again until it gets them back this way."""
        replaced: dict = {}
        if self._staged is not None and update_successful:
            for dtype, error in self._staged.items():
                replaced[dtype], self.errors[dtype] = self.errors[dtype], error
        self._staged = None
        return replaced

    def state_dict(self) -> dict:
        return {"errors": {str(dtype): error.clone() for dtype, error in self.errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        for dtype, error in self.errors.items():
            saved = state["errors"][str(dtype)]
            if saved.shape != error.shape:
                raise ValueError(f"{self.reducer_name} error buffer of {saved.numel()} elements "
                                 f"does not fit this model chunk ({error.numel()}); load with the "
                                 f"same model and parallel layout, or without the optimizer state")
            error.copy_(saved)
