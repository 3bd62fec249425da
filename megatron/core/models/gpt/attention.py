"""Causal self-attention with heads split over the tensor-parallel ranks.

``linear_qkv`` is column-parallel with Megatron's interleaved layout: the full weight's rows are
``[heads, 3 (q, k, v), head_dim]``, so a contiguous block of rows is whole heads. ``linear_proj`` is
row-parallel. The core is ``scaled_dot_product_attention`` (fused), with attention dropout drawn from
a stream seeded per (layer, TP rank, micro-batch) (:func:`attention_dropout_seed`): Megatron's
semantics, where TP ranks draw independent masks for their heads, so TP=2 is *a* valid model but not
bit-for-bit the TP=1 model. With ``--layout-invariant-attention-dropout`` the core is an explicit
s x s softmax whose dropout mask comes from :class:`CounterBasedDropout` at the coordinates (global
head, query, key) of the full attention-probability tensor, so a TP rank drops exactly what the
unsplit model drops for its heads (what the layout-equivalence tests use; slower).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import (SITE_ATTENTION_PROBS, DropoutContext,
                                                  attention_dropout_seed, seeded_rng)
from megatron.core.tensor_parallel.utils import divide


class SelfAttention(torch.nn.Module):
    """Multi-head causal self-attention on ``[s, b, h]``; ``layer_number`` is 1-based and global."""

    def __init__(self, config, layer_number: int, parallel_state, *, init_std: float,
                 output_init_std: float, params_dtype, device=None):
        super().__init__()
        self.layer_number = layer_number
        self.attention_dropout = config.attention_dropout
        self.num_heads = config.num_attention_heads
        self.head_dim = divide(config.hidden_size, self.num_heads,
                               "hidden-size (must be a multiple of num-attention-heads)")
        self.heads_per_rank = divide(
            self.num_heads, parallel_state.tp_size,
            "num-attention-heads (must be a multiple of tensor-model-parallel-size)")
        self.tp_rank = parallel_state.tp_rank
        self.first_head = parallel_state.tp_rank * self.heads_per_rank
        bias = not config.disable_bias_linear
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, parallel_state, bias=bias,
            init_std=init_std, params_dtype=params_dtype, device=device)
        self.linear_proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, parallel_state, bias=bias,
            init_std=output_init_std, params_dtype=params_dtype, device=device)

    def forward(self, hidden: torch.Tensor, dropout: DropoutContext,
                recompute_core: bool = False) -> torch.Tensor:
        seq_len, batch, _ = hidden.shape
        qkv = self.linear_qkv(hidden).view(seq_len, batch, self.heads_per_rank, 3, self.head_dim)
        # [s, b, heads/tp, hn] -> [b, heads/tp, s, hn]
        query, key, value = (t.permute(1, 2, 0, 3) for t in qkv.unbind(dim=3))
        if recompute_core:  # selective recomputation: keep only q, k, v, redo the s x s part
            context = checkpoint(self.core_attention, query, key, value, dropout,
                                 use_reentrant=False)
        else:
            context = self.core_attention(query, key, value, dropout)
        # [b, heads/tp, s, hn] -> [s, b, h/tp]
        context = context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)
        return self.linear_proj(context)

    def core_attention(self, query, key, value, dropout: DropoutContext) -> torch.Tensor:
        """softmax(q k^T / sqrt(hn) + causal mask), dropout, times v; ``[b, heads/tp, s, hn]``."""
        probability = self.attention_dropout if dropout.enabled else 0.0
        if probability == 0.0:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True)
        if not dropout.layout_invariant_attention:
            seed = attention_dropout_seed(dropout.dropout.seed, self.layer_number, self.tp_rank,
                                          dropout.first_sample)
            with seeded_rng(seed, query.device):
                return F.scaled_dot_product_attention(query, key, value, dropout_p=probability,
                                                      is_causal=True)
        return self.layout_invariant_core_attention(query, key, value, probability, dropout)

    def layout_invariant_core_attention(self, query, key, value, probability: float,
                                        dropout: DropoutContext) -> torch.Tensor:
        """Explicit s x s softmax with counter-based masks (--layout-invariant-attention-dropout)."""
        seq_len = query.shape[2]
        scores = torch.matmul(query, key.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype,
                                                                         torch.float32))
        probs = dropout.dropout.apply(
            probs.to(query.dtype), probability, self.layer_number, SITE_ATTENTION_PROBS,
            dropout.sample_ids, full_shape=(self.num_heads, seq_len, seq_len),
            offsets=(self.first_head, 0, 0))
        return torch.matmul(probs, value)
