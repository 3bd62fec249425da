"""Global gradient norm across every model-parallel rank, and clipping by it.

Each parameter must be counted exactly once in the norm. A parameter split over tensor-parallel ranks
(``tensor_model_parallel = True``) contributes its shard from every rank; a parameter replicated on all
tensor-parallel ranks (norms, row-parallel biases) contributes only from tensor-parallel rank 0. The
pipeline runtime knows more duplicates (tied embeddings held by the first and last stage, the two
replicas of a Chimera stage), so the predicate deciding who "owns" a parameter's contribution is taken
from the caller; :func:`default_owns_grad_norm` is the rule without pipelines.

Squared norms are summed over the tensor- and then the pipeline-parallel group. Data-parallel replicas
hold identical (already reduced) gradients and are not summed.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from megatron.core.distributed.collectives import all_reduce_over


def default_owns_grad_norm(parallel_state) -> Callable[[torch.nn.Parameter], bool]:
    """Predicate: the parameter's gradient counts toward the norm on this rank (no pipeline)."""
    tp_rank = parallel_state.tp_rank

    def owns(param: torch.nn.Parameter) -> bool:
        return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0

    return owns


def global_grad_norm(params: Iterable[torch.nn.Parameter],
                     owns_grad_norm: Callable[[torch.nn.Parameter], bool],
                     parallel_state) -> float:
    """L2 norm of all gradients of the whole model, identical on every rank.

    ``params`` are this rank's parameters; only those for which ``owns_grad_norm`` is true contribute.
    Returns ``nan``/``inf`` when a gradient is not finite.
    """
    squares = squared_grad_norm(params, owns_grad_norm, parallel_state)
    all_reduce_over(squares, [parallel_state.tensor_group, parallel_state.pipeline_group])
    return float(squares.sqrt().item())


def squared_grad_norm(params: Iterable[torch.nn.Parameter],
                      owns_grad_norm: Callable[[torch.nn.Parameter], bool],
                      parallel_state) -> torch.Tensor:
    """This rank's sum of squared gradient elements of the parameters it owns (float64, [1])."""
    grads = [param.grad.detach() for param in params
             if param.grad is not None and owns_grad_norm(param)]
    if grads:
        device = grads[0].device
        # Per-tensor norms in one fused call, then squares summed in float64 so the total is as
        # independent of how the model is split as possible.
        # Half-precision gradients are promoted to float32 (their squares overflow); float64
        # gradients keep float64, so a float64 model's norm is not rounded to float32.
        norms = torch._foreach_norm([g.to(torch.promote_types(g.dtype, torch.float32))
                                     for g in grads])
        squares = torch.stack([n.to(device) for n in norms]).double().pow(2).sum().reshape(1)
    else:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if parallel_state.backend == "nccl" else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float64, device=device)
    return squares  # gloo and nccl both reduce float64


def clip_grads_by_norm(params: Iterable[torch.nn.Parameter], max_norm: float,
                       total_norm: float) -> None:
    """Scale all gradients by ``max_norm / (total_norm + 1e-6)`` when that is below 1.

    Same coefficient as ``torch.nn.utils.clip_grad_norm_`` and Megatron-LM.
    """
    clip_coefficient = max_norm / (total_norm + 1.0e-6)
    if clip_coefficient >= 1.0:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, clip_coefficient)
