"""Optimizer, learning-rate schedule, loss scaling and global-norm gradient clipping."""

from megatron.core.optimizer.clip_grads import (clip_grads_by_norm, default_owns_grad_norm,
                                                global_grad_norm)
from megatron.core.optimizer.grad_scaler import (ConstantGradScaler, DynamicGradScaler,
                                                 build_grad_scaler)
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler, build_lr_scheduler
from megatron.core.optimizer.builder import build_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer, StepResult, build_param_groups

__all__ = [
    "ConstantGradScaler", "DynamicGradScaler", "MegatronOptimizer", "OptimizerParamScheduler",
    "StepResult", "build_grad_scaler", "build_lr_scheduler", "build_optimizer",
    "build_param_groups", "clip_grads_by_norm", "default_owns_grad_norm", "global_grad_norm",
]
