"""The run's optimizer, chosen from the config: :class:`~.optimizer.MegatronOptimizer` or, with
``--use-distributed-optimizer``, :class:`~.distributed.DistributedOptimizer`.

It lives in its own module because it depends on both optimizer modules (and the distributed one
builds on the plain one), so neither of them has to import the other back.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from megatron.core.optimizer.decoupled_lr import (embedding_or_output_parameters,
                                                  split_decoupled_groups)
from megatron.core.optimizer.distributed import build_distributed_optimizer
from megatron.core.optimizer.grad_scaler import build_grad_scaler
from megatron.core.optimizer.mup import mup_width_mult, split_mup_groups
from megatron.core.optimizer.optimizer import (MegatronOptimizer, build_param_groups,
                                               torch_optimizer)


def build_optimizer(config, params: Iterable[torch.nn.Parameter], parallel_state, *,
                    owns_grad_norm: Optional[Callable[[torch.nn.Parameter], bool]] = None,
                    gradient_reducers: Iterable = (),
                    model_chunks: Iterable = ()) -> MegatronOptimizer:
    """The run's optimizer from ``config.optimizer`` and ``config.training`` (precision).

    With ``--use-distributed-optimizer`` the sharded reducers among ``gradient_reducers`` decide
    which elements this rank steps (:class:`~.distributed.DistributedOptimizer`).
    """
    optimizer_config = config.optimizer
    params = list(params)
    if getattr(config.parallel, "use_distributed_optimizer", False):
        return build_distributed_optimizer(config, params, parallel_state, owns_grad_norm,
                                           list(gradient_reducers), list(model_chunks))
    groups = build_param_groups(params, optimizer_config.weight_decay)
    if getattr(optimizer_config, "decoupled_lr", None) is not None:
        groups = split_decoupled_groups(groups, embedding_or_output_parameters(model_chunks),
                                        optimizer_config)
    groups = split_mup_groups(groups, optimizer_config, mup_width_mult(config))
    optimizer, implementation = torch_optimizer(groups, optimizer_config)
    return MegatronOptimizer(
        optimizer, params, parallel_state, clip_grad=optimizer_config.clip_grad,
        grad_scaler=build_grad_scaler(optimizer_config, config.training),
        owns_grad_norm=owns_grad_norm, implementation=implementation)
