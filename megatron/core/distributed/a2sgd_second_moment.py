"""Adam's second moment from A2SGD's exact steps only (``--a2sgd-second-moment-from-exact-steps``).

Between syncs A2SGD hands the optimizer a two-level gradient: every entry of a segment carries one of
two means, so its magnitude says nothing about that coordinate. Adam's second moment ``v`` then
learns the segment mean for every coordinate instead of each coordinate's own scale, and a step
of Adam is no longer linear in the gradient, so error feedback (which makes the *sum* of applied
gradients track the sum of true ones) no longer makes the sum of updates track all-reduce's.

With a flushing sync (``--a2sgd-sync-flushes-errors``) or a flush interval
(``--a2sgd-flush-interval``) some steps apply the exact data-parallel mean of ``g + e``. This
keeper lets only those steps shape ``v``: before each step it snapshots ``v`` of the reducer's
parameters; after a two-level step it restores the snapshot (the step itself divided by the
snapshot plus this step's ``(1 - beta2) a^2``, Adam's own update order); after an exact step it sets
``v = beta2^n v_old + (1 - beta2^n) g^2``, as if the exact gradient ``g`` (after clipping) had been
seen at each of the ``n`` optimizer steps since the previous exact one (this one included; for the
first exact step, its own step count ``t``: ``n = 1`` at ``t = 1``, Adam's own first step). ``n``
counts the steps the optimizer took: a skipped step (overflow, non-finite norm) does not advance
Adam's ``t`` and is not counted. So ``v`` keeps the weight ``1 - beta2^t`` that Adam's bias
correction assumes. With ``v`` fixed between exact steps Adam's update is linear in the gradient
there, as error feedback needs. The reducer retries a skipped exact step at the next step (else a
skipped first step, e.g. fp16's first overflow, would leave ``v = 0`` under the two-level steps).

Before 2026-12-02 (evening) ``n`` was the sync interval for every exact step, the first one and
those of a flush interval included (see docs/a2sgd.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class SecondMomentFromExactSteps:
    """Keeps Adam's ``exp_avg_sq`` of ``params`` shaped by exact steps only (see the module).

    Args:
        params: the parameters whose second moment is kept (the A2SGD reducer's).

    :attr:`steps_since_exact` counts the optimizer steps taken since the last exact step (0 at
    the start); the owner keeps it in checkpoints (:meth:`.A2SGDReducer.state_dict`).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self.steps_since_exact = 0
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._beta2: dict = {}
        self._snapshot: Optional[list] = None
        self.step_is_exact = False  # what before_step() was told about the current step

    def attach(self, torch_optimizer: torch.optim.Optimizer) -> None:
        """Read ``beta2`` of every parameter from Adam/AdamW and keep the optimizer, whose
        ``state`` is read at each step (``load_state_dict`` of a resume replaces that dict)."""
        for group in torch_optimizer.param_groups:
            if "betas" not in group:
                raise ValueError("--a2sgd-second-moment-from-exact-steps needs --optimizer adam "
                                 f"(the optimizer has no betas: {type(torch_optimizer).__name__})")
            for param in group["params"]:
                self._beta2[param] = float(group["betas"][1])
        missing = [p for p in self.params if p not in self._beta2]
        if missing:
            raise ValueError(f"{len(missing)} A2SGD parameters are not the optimizer's own "
                             "(--a2sgd-second-moment-from-exact-steps needs fp32/bf16 training "
                             "without separate main parameters)")
        self._optimizer = torch_optimizer

    def before_step(self, exact: bool) -> None:
        """Snapshot ``v`` (zeros where the optimizer has made no state yet); ``exact``: this step
        applies the exact mean gradient."""
        if self._optimizer is None:
            raise RuntimeError("attach() the optimizer before the first step")
        self.step_is_exact = exact
        self._snapshot = [self._second_moment(p).clone() if self._has_state(p)
                          else torch.zeros_like(p, memory_format=torch.preserve_format)
                          for p in self.params]

    def after_step(self, ok: bool) -> None:
        """Restore ``v`` after a two-level step, or weight the exact gradient over the optimizer
        steps since the last exact one after an exact step; nothing when the step was skipped
        (``ok`` False: the optimizer did not step, the snapshot is ``v`` already, and the step
        is not counted)."""
        snapshot, self._snapshot = self._snapshot, None
        if not ok or snapshot is None:
            return
        self.steps_since_exact += 1  # this step, one of Adam's
        steps = self.steps_since_exact
        if self.step_is_exact:
            self.steps_since_exact = 0
        with torch.no_grad():
            for param, old in zip(self.params, snapshot):
                if not self._has_state(param):
                    continue
                second_moment = self._second_moment(param)
                if not self.step_is_exact:
                    second_moment.copy_(old)
                    continue
                decay = self._beta2[param] ** steps
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                torch.mul(old, decay, out=second_moment)
                second_moment.addcmul_(grad, grad, value=1.0 - decay)

    def _state(self) -> dict:
        """The optimizer's current per-parameter state (read anew: a resume replaces it)."""
        assert self._optimizer is not None, "attach() the optimizer first"
        return self._optimizer.state

    def _has_state(self, param: torch.nn.Parameter) -> bool:
        return "exp_avg_sq" in self._state().get(param, {})

    def _second_moment(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._state()[param]["exp_avg_sq"]
