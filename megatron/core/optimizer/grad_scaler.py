"""Loss scaling for fp16 training (Megatron-LM semantics).

The loss is multiplied by ``scale`` before backward and the gradients divided by it afterwards. With
dynamic scaling an overflow (inf/nan in any gradient on any rank) skips the step; after ``hysteresis``
overflows the scale is halved (not below ``min_scale``), and after ``growth_interval`` consecutive clean
steps it doubles and the hysteresis budget is refilled.
"""

from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """A static scale never changes (overflowing steps are still skipped)."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Megatron's dynamic loss scaler with hysteresis."""

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int,
                 hysteresis: int, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError("--initial-loss-scale and --min-loss-scale must be positive")
        if min_scale > initial_scale:
            raise ValueError(f"--min-loss-scale {min_scale} exceeds --initial-loss-scale "
                             f"{initial_scale}; lower --min-loss-scale")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("--loss-scale-window and --hysteresis must be at least 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (``found_inf``) or did not overflow."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(optimizer_config, training_config):
    """The scaler for the run's precision: ``None`` unless ``--fp16``."""
    if not training_config.fp16:
        return None
    if optimizer_config.loss_scale is not None:
        return ConstantGradScaler(optimizer_config.loss_scale)
    return DynamicGradScaler(
        initial_scale=optimizer_config.initial_loss_scale,
        min_scale=optimizer_config.min_loss_scale,
        growth_interval=optimizer_config.loss_scale_window,
        hysteresis=optimizer_config.hysteresis)
