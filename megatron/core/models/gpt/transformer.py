"""Pre-LN GPT transformer layers and the block that runs (and recomputes) a range of them.

Layers live in ``decoder.layers`` keyed by their GLOBAL index, so a pipeline chunk holding layers
4..7 has parameters named ``decoder.layers.4.…`` exactly like the full model.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatron.core.models.gpt.attention import SelfAttention
from megatron.core.models.gpt.mlp import MLP
from megatron.core.models.gpt.mup import mup_scales
from megatron.core.models.gpt.norm import Norm
from megatron.core.tensor_parallel.random import (
    SITE_ATTENTION_OUTPUT, SITE_MLP_OUTPUT, DropoutContext)
from megatron.core.tensor_parallel.utils import tensor_parallel_group


class TransformerLayer(torch.nn.Module):
    """``x + drop(attn(ln(x)))`` then ``x + drop(mlp(ln(x)))`` on ``[s, b, h]``."""

    def __init__(self, config, layer_index: int, parallel_state, *, params_dtype, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.layer_number = layer_index + 1  # 1-based like Megatron; 0 is the embedding
        self.hidden_dropout = config.hidden_dropout
        scales = mup_scales(config)  # GPT-2's scaled init; MuP divides both by sqrt(width)
        common = dict(init_std=scales.hidden_init_std, output_init_std=scales.output_init_std,
                      params_dtype=params_dtype, device=device,
                      sequence_parallel=sequence_parallel)
        norm_group = tensor_parallel_group(parallel_state) if sequence_parallel else None
        self.input_layernorm = Norm(config, params_dtype=params_dtype, device=device,
                                    gradient_group=norm_group)
        self.self_attention = SelfAttention(config, self.layer_number, parallel_state, **common)
        self.pre_mlp_layernorm = Norm(config, params_dtype=params_dtype, device=device,
                                      gradient_group=norm_group)
        self.mlp = MLP(config, parallel_state, **common)

    def forward(self, hidden: torch.Tensor, dropout: DropoutContext,
                recompute_attention_core: bool = False) -> torch.Tensor:
        attention = self.self_attention(self.input_layernorm(hidden), dropout,
                                        recompute_attention_core)
        hidden = hidden + dropout.hidden(attention, self.hidden_dropout, self.layer_number,
                                         SITE_ATTENTION_OUTPUT)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + dropout.hidden(mlp, self.hidden_dropout, self.layer_number,
                                       SITE_MLP_OUTPUT)


def resolve_recompute(recompute_config) -> tuple[str | None, str | None, int]:
    """(granularity, method, num_layers) with Megatron's legacy spellings and defaults applied.

    ``checkpoint_activations`` means full/uniform, ``recompute_activations`` means selective;
    full without a method is uniform, and a missing layer count is 1.
    """
    if recompute_config is None:
        return None, None, 0
    granularity = recompute_config.recompute_granularity
    method = recompute_config.recompute_method
    if granularity is None and getattr(recompute_config, "checkpoint_activations", False):
        granularity, method = "full", method or "uniform"
    if granularity is None and getattr(recompute_config, "recompute_activations", False):
        granularity = "selective"
    if granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute-granularity {granularity!r} is not one of full, selective")
    if granularity != "full":
        return granularity, None, 0
    method = method or "uniform"
    if method not in ("uniform", "block"):
        raise ValueError(f"recompute-method {method!r} is not one of uniform, block")
    num_layers = recompute_config.recompute_num_layers
    num_layers = 1 if num_layers is None else num_layers
    if num_layers < 0 or (method == "uniform" and num_layers == 0):
        raise ValueError(f"recompute-num-layers {num_layers} must be >= 1 (uniform) or >= 0 "
                         f"(block)")
    return granularity, method, num_layers


class TransformerBlock(torch.nn.Module):
    """The layers ``layer_range`` (global indices) and, on the last stage, the final norm."""

    def __init__(self, config, layer_range: range, parallel_state, recompute_config, *,
                 final_layernorm: bool, params_dtype, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleDict({
            str(index): TransformerLayer(config, index, parallel_state,
                                         params_dtype=params_dtype, device=device,
                                         sequence_parallel=sequence_parallel)
            for index in layer_range})
        norm_group = tensor_parallel_group(parallel_state) if sequence_parallel else None
        self.final_layernorm = (Norm(config, params_dtype=params_dtype, device=device,
                                     gradient_group=norm_group)
                                if final_layernorm else None)
        self.granularity, self.method, self.recompute_num_layers = \
            resolve_recompute(recompute_config)

    def forward(self, hidden: torch.Tensor, dropout: DropoutContext) -> torch.Tensor:
        layers = list(self.layers.values())
        selective = self.granularity == "selective"
        if self.granularity == "full" and self.method == "uniform":
            # Checkpoint groups of recompute_num_layers consecutive layers: only each group's
            # input is stored, the rest is recomputed in the backward pass.
            for start in range(0, len(layers), self.recompute_num_layers):
                group = layers[start:start + self.recompute_num_layers]
                hidden = checkpoint(_run_layers, group, hidden, dropout, use_reentrant=False)
        elif self.granularity == "full":  # block: the first recompute_num_layers layers only
            for position, layer in enumerate(layers):
                if position < self.recompute_num_layers:
                    hidden = checkpoint(layer, hidden, dropout, use_reentrant=False)
                else:
                    hidden = layer(hidden, dropout)
        else:
            for layer in layers:
                hidden = layer(hidden, dropout, selective)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden


def _run_layers(layers, hidden, dropout):
    for layer in layers:
        hidden = layer(hidden, dropout)
    return hidden
