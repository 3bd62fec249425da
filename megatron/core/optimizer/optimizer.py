"""The optimizer step of one iteration: unscale, overflow check, clip, update.

:class:`MegatronOptimizer` wraps a torch optimizer (AdamW by default) whose parameters are the model's
own fp32 parameters; mixed precision only changes the forward (``torch.autocast``), so there is no
separate master copy. The step, in order:

1. fp16: divide gradients by the loss scale and look for inf/nan on *every* rank (one all-reduce over
   the world); an overflow skips the update, is reported, and lets the dynamic scaler shrink.
2. Global gradient norm over all model-parallel ranks (each parameter counted once, see
   :mod:`megatron.core.optimizer.clip_grads`), then clipping to ``--clip-grad``.
3. A non-finite norm (bf16/fp32 have no scaler to catch it) also skips the update.
4. The update.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from megatron.core.distributed.collectives import all_reduce_world
from megatron.core.optimizer.clip_grads import (clip_grads_by_norm, default_owns_grad_norm,
                                                global_grad_norm)


@dataclass(frozen=True)
class CountedOnce:
    """Tensors of this rank that, summed over ``groups`` (in turn), hold every element of the
    model's parameters exactly once: ``values`` the parameters, ``grads`` their gradients (``None``
    where there is none), pairwise. See :meth:`MegatronOptimizer.counted_once`."""

    values: list[torch.Tensor]
    grads: list[Optional[torch.Tensor]]
    groups: list


@dataclass
class StepResult:
    """Outcome of :meth:`MegatronOptimizer.step`.

    ``grad_norm`` is the norm before clipping (``None`` when an fp16 overflow skipped the step, as in
    Megatron's log). ``found_inf`` is true for an fp16 overflow.
    """

    update_successful: bool
    grad_norm: Optional[float]
    found_inf: bool = False


def build_param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW groups: with weight decay, and without it for biases and norms.

    A parameter opts out through ``no_weight_decay = True`` (set by the model on biases and norm
    weights); parameters without that attribute fall back to Megatron's rule (1-D tensors are biases
    or norms).
    """
    decay, no_decay = [], []
    for param in params:
        if not param.requires_grad:
            continue
        flag = getattr(param, "no_weight_decay", None)
        skip = flag if flag is not None else param.ndim < 2
        (no_decay if skip else decay).append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _adamw(groups: list[dict], optimizer_config) -> tuple[torch.optim.Optimizer, str]:
    """AdamW, preferring torch's fused kernel, then apex's FusedAdam on CUDA, then foreach."""
    kwargs = dict(lr=optimizer_config.lr or 0.0,
                  betas=(optimizer_config.adam_beta1, optimizer_config.adam_beta2),
                  eps=optimizer_config.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs), "torch fused AdamW"
    except (RuntimeError, TypeError, ValueError):
        pass  # fused unsupported for this device/dtype in this torch build
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    if on_cuda and importlib.util.find_spec("apex") is not None:
        try:
            from apex.optimizers import FusedAdam  # optional accelerator
            return FusedAdam(groups, adam_w_mode=True, **kwargs), "apex FusedAdam"
        except ImportError:
            pass  # the PyPI package named "apex" is unrelated to NVIDIA apex
    return torch.optim.AdamW(groups, foreach=True, **kwargs), "torch foreach AdamW"


class MegatronOptimizer:
    """Optimizer with loss scaling, overflow skipping and global-norm clipping.

    Args:
        optimizer: the torch optimizer over ``params``.
        params: every parameter this rank updates.
        parallel_state: the process-group handle (norm and overflow reductions).
        clip_grad: maximum global gradient norm; 0 disables clipping (the norm is still reported).
        grad_scaler: ``None`` (fp32/bf16) or a loss scaler (fp16).
        owns_grad_norm: which parameters contribute to the norm on this rank (see clip_grads).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                 parallel_state, *, clip_grad: float = 0.0, grad_scaler=None,
                 owns_grad_norm: Optional[Callable[[torch.nn.Parameter], bool]] = None,
                 implementation: str = ""):
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.parallel_state = parallel_state
        self.clip_grad = float(clip_grad)
        self.grad_scaler = grad_scaler
        self.owns_grad_norm = owns_grad_norm or default_owns_grad_norm(parallel_state)
        self.implementation = implementation

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16)."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    def zero_grad(self) -> None:
        """Zero gradients in place; they may be views of a reducer's contiguous buffer."""
        grads = self._grads()
        if grads:
            torch._foreach_zero_(grads)  # one call instead of one per parameter

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient this optimizer steps by ``factor`` (before :meth:`step`; used
        by --calculate-per-token-loss once the global batch's token count is known)."""
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, factor)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _unscale_and_check_overflow(self) -> bool:
        grads = self._grads()
        device = grads[0].device if grads else (
            torch.device("cuda", torch.cuda.current_device())
            if self.parallel_state.backend == "nccl" else torch.device("cpu"))
        found_inf = torch.zeros(1, device=device)
        by_device: dict = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for grad_device, device_grads in by_device.items():
            # One fused pass: multiply by 1/scale and flag any inf/nan, without a host sync per
            # tensor.
            flag = torch.zeros(1, device=grad_device)
            inverse_scale = torch.full((1,), 1.0 / self.grad_scaler.scale, device=grad_device)
            torch._amp_foreach_non_finite_check_and_unscale_(device_grads, flag, inverse_scale)
            found_inf = torch.maximum(found_inf, flag.to(device))
        all_reduce_world(found_inf, op=torch.distributed.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def step(self) -> StepResult:
        """Unscale, check, clip and update; see the module docstring."""
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_overflow()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return StepResult(update_successful=False, grad_norm=None, found_inf=True)
        grad_norm = self.global_grad_norm()
        if not math.isfinite(grad_norm):
            return StepResult(update_successful=False, grad_norm=grad_norm)
        if self.clip_grad > 0:
            clip_grads_by_norm(self.params, self.clip_grad, grad_norm)
        self.optimizer.step()
        self.after_update()
        return StepResult(update_successful=True, grad_norm=grad_norm)

    def global_grad_norm(self) -> float:
        """The norm of the whole model's gradient (see :mod:`~.clip_grads`)."""
        return global_grad_norm(self.params, self.owns_grad_norm, self.parallel_state)

    def counted_once(self) -> list[CountedOnce]:
        """The model's elements, each counted once over all ranks, with the gradient norm's rule
        (what ``--log-params-norm`` and ``--log-num-zeros-in-grad`` sum): the parameters this rank
        owns, summed over the tensor- and pipeline-parallel groups."""
        owned = [param for param in self.params if self.owns_grad_norm(param)]
        return [CountedOnce([param.detach() for param in owned], [param.grad for param in owned],
                            [self.parallel_state.tensor_group, self.parallel_state.pipeline_group])]

    def after_update(self) -> None:
        """Hook after the parameters changed (the distributed optimizer gathers its shards)."""

    def finish_parameter_gather(self) -> None:
        """Wait for parameter updates still in flight (``--overlap-param-gather``); call it
        before reading the parameters outside a forward pass. Nothing is in flight here."""

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])


def torch_optimizer(groups: list[dict], optimizer_config) -> tuple[torch.optim.Optimizer, str]:
    """The torch optimizer ``--optimizer`` names, over ``groups``, and a line describing it."""
    if not groups:
        raise ValueError("the model has no trainable parameters")
    if optimizer_config.optimizer == "adam":
        return _adamw(groups, optimizer_config)
    if optimizer_config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optimizer_config.lr or 0.0,
                               momentum=optimizer_config.sgd_momentum), "torch SGD"
    raise ValueError(f"unknown --optimizer {optimizer_config.optimizer!r}; use adam or sgd")
