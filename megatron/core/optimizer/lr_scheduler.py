"""Learning-rate schedule with Megatron-LM's semantics.

The schedule counts *samples*, not iterations: after each successful optimizer step the caller advances
it by the global batch size (a skipped fp16 step does not advance it). The learning rate used by an
iteration is the one computed before its step, so with warm-up the first iteration runs at lr 0, exactly
as in Megatron-LM.

    warm-up (linear 0 -> max_lr over warmup_steps), then
    constant: max_lr
    linear:   min_lr + (1 - r) * (max_lr - min_lr)
    cosine:   min_lr + 0.5 * (cos(pi * r) + 1) * (max_lr - min_lr)
    with r = (step - warmup_steps) / (decay_steps - warmup_steps), and min_lr after decay_steps.
"""

from __future__ import annotations

import math
from typing import Optional

DECAY_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Sets ``lr`` on every param group of ``optimizer`` from the sample count."""

    def __init__(self, optimizer, *, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, init_lr: float = 0.0):
        if lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"unknown --lr-decay-style {lr_decay_style!r}; use one of "
                             f"{', '.join(DECAY_STYLES)}")
        if min_lr > max_lr:
            raise ValueError(f"--min-lr {min_lr} is larger than --lr {max_lr}; lower --min-lr")
        if lr_decay_steps <= 0:
            raise ValueError("the learning-rate decay length is zero; set --lr-decay-iters or "
                             "--train-iters to a positive value")
        if lr_warmup_steps >= lr_decay_steps and lr_decay_style != "constant":
            raise ValueError(
                f"warm-up ({lr_warmup_steps} samples) is not shorter than the decay "
                f"({lr_decay_steps} samples); lower --lr-warmup-iters/--lr-warmup-fraction or "
                f"raise --lr-decay-iters")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.lr_decay_steps = int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, num_steps: Optional[int] = None, param_group: Optional[dict] = None) -> float:
        """Learning rate after ``num_steps`` samples (default: the current count), for a param
        group that may carry its own ``max_lr`` / ``min_lr`` (``--decoupled-lr``)."""
        steps = self.num_steps if num_steps is None else num_steps
        group = param_group or {}
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if steps > self.lr_decay_steps:
            return min_lr
        decay_ratio = (steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coefficient = 1.0 - decay_ratio
        else:  # cosine
            coefficient = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coefficient * (max_lr - min_lr)

    def step(self, increment: int) -> float:
        """Advance by ``increment`` samples and write the new lr into the param groups; returns
        the main schedule's lr."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(param_group=group)
        return self.get_lr()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "lr_warmup_steps": self.lr_warmup_steps, "lr_decay_steps": self.lr_decay_steps,
                "lr_decay_style": self.lr_decay_style}

    # The schedule's shape as the checkpoint stores it (besides the position, num_steps).
    SHAPE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")

    def load_state_dict(self, state: dict, *, use_checkpoint_values: bool = False) -> list[str]:
        """Restore the position and, with ``use_checkpoint_values`` (Megatron's
        ``--use-checkpoint-opt_param-scheduler``), the schedule's shape from ``state``; otherwise
        the shape stays the one of the current flags (``--override-opt_param-scheduler``).

        Returns one line per shape value in which flags and checkpoint differ, saying which one
        is used (the caller logs them)."""
        differences = []
        for key in self.SHAPE_KEYS:
            if key in state and state[key] != getattr(self, key):
                kept = state[key] if use_checkpoint_values else getattr(self, key)
                differences.append(f"{key}: flags {getattr(self, key)}, checkpoint {state[key]}; "
                                   f"using {kept} (from the "
                                   f"{'checkpoint' if use_checkpoint_values else 'flags'})")
                if use_checkpoint_values:
                    setattr(self, key, type(getattr(self, key))(state[key]))
        self.num_steps = 0
        self.step(int(state["num_steps"]))
        return differences


def build_lr_scheduler(optimizer, optimizer_config, training_config) -> OptimizerParamScheduler:
    """Megatron's sample-based schedule from ``--lr --min-lr --lr-decay-style --lr-decay-iters
    --lr-warmup-iters --lr-warmup-fraction`` and the batch size / iteration count."""
    if optimizer_config.lr is None:
        raise ValueError("no learning rate given; pass --lr")
    if optimizer_config.lr_decay_samples is not None:  # samples-based training
        decay_steps = optimizer_config.lr_decay_samples
        warmup_steps = optimizer_config.lr_warmup_samples
    else:
        decay_steps, warmup_steps = _iteration_based_steps(optimizer_config, training_config)
    if optimizer_config.lr_warmup_fraction is not None:
        warmup_steps = int(optimizer_config.lr_warmup_fraction * decay_steps)
    return OptimizerParamScheduler(
        optimizer, max_lr=optimizer_config.lr, min_lr=optimizer_config.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=optimizer_config.lr_decay_style)


def _iteration_based_steps(optimizer_config, training_config) -> tuple[int, int]:
    """(decay, warm-up) in samples from --lr-decay-iters / --lr-warmup-iters x the global batch."""
    global_batch_size = training_config.global_batch_size
    train_iters = training_config.train_iters
    if train_iters is None and training_config.train_samples is not None:
        train_iters = training_config.train_samples // global_batch_size
    decay_iters = optimizer_config.lr_decay_iters or train_iters
    if decay_iters is None:
        raise ValueError("cannot size the learning-rate schedule; pass --train-iters or "
                         "--lr-decay-iters")
    return decay_iters * global_batch_size, optimizer_config.lr_warmup_iters * global_batch_size
