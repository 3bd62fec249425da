"""Adam's second moment from A2SGD's exact steps only (``--a2sgd-second-moment-from-exact-steps``).

Between syncs A2SGD hands the optimizer a two-level gradient: every entry of a segment carries one of
two means, so its magnitude says nothing about that coordinate. Adam's second moment ``v`` then
learns the segment mean for every coordinate instead of each coordinate's own scale, and a step
of Adam is no longer linear in the gradient, so error feedback (which makes the *sum* of applied
gradients track the sum of true ones) no longer makes the sum of updates track all-reduce's.

With a flushing sync (``--a2sgd-sync-flushes-errors``) every ``k``-th step applies the exact
data-parallel mean of ``g + e``. This keeper lets only those steps shape ``v``: before each step it
snapshots ``v`` of the reducer's parameters; after a two-level step it restores the snapshot (the
step itself divided by the snapshot plus this step's ``(1 - beta2) a^2``, Adam's own update order);
after an exact step it sets ``v = beta2^k v_old + (1 - beta2^k) g^2``, as if the exact gradient
``g`` (after clipping) had been seen at each of the ``k`` steps since the last exact one, so ``v``
keeps the weight Adam's bias correction ``1 - beta2^t`` assumes. With ``v`` fixed between exact
steps Adam's update is linear in the gradient there, as error feedback needs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class SecondMomentFromExactSteps:
    """Keeps Adam's ``exp_avg_sq`` of ``params`` shaped by exact steps only (see the module).

    Args:
        params: the parameters whose second moment is kept (the A2SGD reducer's).
        interval: steps per exact step (the sync interval ``k``).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], interval: int):
        if interval < 1:
            raise ValueError(f"the sync interval must be >= 1 (got {interval})")
        self.params = list(params)
        self.interval = int(interval)
        self._state: dict = {}
        self._attached = False
        self._beta2: dict = {}
        self._snapshot: Optional[list] = None
        self._exact = False

    def attach(self, torch_optimizer: torch.optim.Optimizer) -> None:
        """Read ``beta2`` of every parameter and the state dict from Adam/AdamW."""
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
        self._state = torch_optimizer.state
        self._attached = True

    def before_step(self, exact: bool) -> None:
        """Snapshot ``v`` (zeros where the optimizer has made no state yet); ``exact``: this step
        applies the exact mean gradient."""
        if not self._attached:
            raise RuntimeError("attach() the optimizer before the first step")
        self._exact = exact
        self._snapshot = [self._second_moment(p).clone() if self._has_state(p)
                          else torch.zeros_like(p, memory_format=torch.preserve_format)
                          for p in self.params]

    def after_step(self, ok: bool) -> None:
        """Restore ``v`` after a two-level step, or weight the exact gradient over the interval
        after an exact one; nothing when the step was skipped (the snapshot is ``v`` already)."""
        snapshot, self._snapshot = self._snapshot, None
        if not ok or snapshot is None:
            return
        with torch.no_grad():
            for param, old in zip(self.params, snapshot):
                if not self._has_state(param):
                    continue
                second_moment = self._second_moment(param)
                if not self._exact:
                    second_moment.copy_(old)
                    continue
                decay = self._beta2[param] ** self.interval
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                torch.mul(old, decay, out=second_moment)
                second_moment.addcmul_(grad, grad, value=1.0 - decay)

    def _has_state(self, param: torch.nn.Parameter) -> bool:
        return "exp_avg_sq" in self._state.get(param, {})

    def _second_moment(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._state[param]["exp_avg_sq"]
