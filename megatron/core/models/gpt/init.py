"""Layout-independent parameter initialisation.

Every parameter's FULL (unsharded) tensor is drawn from its own ``torch.Generator`` seeded with
``stable_seed(seed, "init", parameter name)``; a TP rank then keeps its block. Because parameter names
are the full model's names in every pipeline chunk, the same seed gives the same full weights for any
TP / PP / DP / Chimera layout, and the two replicas of a Chimera stage start equal.

Normal values are drawn in float32 on the CPU (so every device and parameter dtype sees the same
draws), scaled by the standard deviation in float64 and cast to the parameter's dtype.
"""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.random import stable_seed
from megatron.core.tensor_parallel.utils import full_shape, shard_of


def initial_full_value(name: str, shape: tuple[int, ...], initializer, seed: int) -> torch.Tensor:
    """The full initial tensor (float64, CPU) of parameter ``name`` for ``initializer``."""
    kind, value = initializer
    if kind == "constant":
        return torch.full(shape, float(value), dtype=torch.float64)
    if kind == "normal":
        generator = torch.Generator(device="cpu").manual_seed(stable_seed(seed, "init", name))
        draws = torch.randn(shape, generator=generator, dtype=torch.float32)
        return draws.to(torch.float64) * value
    raise ValueError(f"unknown initializer {initializer!r} of parameter {name}")


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, seed: int, parallel_state) -> None:
    """Set every parameter of ``model`` to its rank's block of the layout-independent full value."""
    tp_rank, tp_size = parallel_state.tp_rank, parallel_state.tp_size
    for name, param in model.named_parameters():
        full = initial_full_value(name, full_shape(param, tp_size), param.initializer, seed)
        if param.tensor_model_parallel:
            full = shard_of(full, param.partition_dim, tp_rank, tp_size)
        param.copy_(full)
