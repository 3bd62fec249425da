"""The MLP: column-parallel h -> ffn, activation, row-parallel ffn -> h.

Activations: GeLU (exact, or tanh with --openai-gelu), squared ReLU (--squared-relu), or SwiGLU
(--swiglu): ``silu(x G^T) * (x U^T)``, where ``linear_fc1`` holds the gate G and the up projection
U stacked as ``[2, ffn, h]`` and split along ``ffn`` (each rank holds its block of both, so the full
tensor is the same for every TP size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(torch.nn.Module):
    """``linear_fc2(activation(linear_fc1(x)))``; each TP rank holds ffn/tp of the hidden units."""

    def __init__(self, config, parallel_state, *, init_std: float, output_init_std: float,
                 params_dtype, device=None, sequence_parallel: bool = False):
        super().__init__()
        bias = not config.disable_bias_linear
        self.swiglu = bool(getattr(config, "swiglu", False))
        self.squared_relu = bool(getattr(config, "squared_relu", False))
        if self.swiglu and self.squared_relu:
            raise ValueError("--swiglu and --squared-relu both choose the MLP activation; give "
                             "one of them")
        self.gelu_approximation = "tanh" if getattr(config, "openai_gelu", False) else "none"
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, parallel_state, bias=bias,
            init_std=init_std, sequence_parallel=sequence_parallel,
            stacked=2 if self.swiglu else 1, params_dtype=params_dtype, device=device)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, parallel_state, bias=bias,
            init_std=output_init_std, sequence_parallel=sequence_parallel,
            params_dtype=params_dtype, device=device)

    def activation(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.squared_relu:
            return F.relu(hidden).square()
        return F.gelu(hidden, approximate=self.gelu_approximation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [s, b, h] -> [s, b, ffn/tp] (SwiGLU: 2 ffn/tp) -> [s, b, h]
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))
