"""The GPT-2 MLP: column-parallel h -> ffn, GeLU (exact, or tanh with --openai-gelu), row-parallel ffn -> h."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(torch.nn.Module):
    """``linear_fc2(gelu(linear_fc1(x)))``; each TP rank holds ffn/tp of the hidden units."""

    def __init__(self, config, parallel_state, *, init_std: float, output_init_std: float,
                 params_dtype, device=None):
        super().__init__()
        bias = not config.disable_bias_linear
        self.gelu_approximation = "tanh" if getattr(config, "openai_gelu", False) else "none"
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, parallel_state, bias=bias,
            init_std=init_std, params_dtype=params_dtype, device=device)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, parallel_state, bias=bias,
            init_std=output_init_std, params_dtype=params_dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # [s, b, h] -> [s, b, ffn/tp] -> [s, b, h]
        return self.linear_fc2(F.gelu(self.linear_fc1(hidden), approximate=self.gelu_approximation))
