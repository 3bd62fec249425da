"""The normalisation layer: LayerNorm or RMSNorm, optionally zero-centred (--apply-layernorm-1p)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import set_parameter_attributes
from megatron.core.tensor_parallel.mappings import sum_gradient_over_tensor_parallel_ranks


class Norm(torch.nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight only), replicated over TP ranks.

    ``size``: the normalised dimension (default hidden-size; the head size for --qk-layernorm).
    With --apply-layernorm-1p the stored weight ``w`` starts at 0 and scales by ``1 + w``.
    ``gradient_group``: a TP group over which the weight's (and bias') gradient is summed in the
    backward pass, for ranks that normalise different parts of the data (sequence blocks under
    sequence parallelism, different heads for the query/key norms); None when they see the same.
    """

    def __init__(self, config, *, params_dtype, device=None, size: int | None = None,
                 gradient_group=None):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {config.normalization!r} is not supported; use "
                             f"LayerNorm or RMSNorm")
        self.kind = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered = bool(getattr(config, "apply_layernorm_1p", False))
        self.gradient_group = gradient_group
        shape = (size or config.hidden_size,)

        def make(value):
            param = torch.nn.Parameter(torch.empty(shape, dtype=params_dtype, device=device))
            param = set_parameter_attributes(param, tensor_model_parallel=False,
                                             initializer=("constant", value), no_weight_decay=True)
            param.sequence_parallel_grad = gradient_group is not None
            return param

        self.weight = make(0.0 if self.zero_centered else 1.0)
        self.bias = make(0.0) if self.kind == "LayerNorm" else None

    def _shared(self, param):
        if param is None or self.gradient_group is None:
            return param
        return sum_gradient_over_tensor_parallel_ranks(param, self.gradient_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self._shared(self.weight), self._shared(self.bias)
        if self.zero_centered:
            weight = weight + 1.0
        if self.kind == "LayerNorm":
            return F.layer_norm(hidden, weight.shape, weight, bias, self.eps)
        return F.rms_norm(hidden, weight.shape, weight, self.eps)
