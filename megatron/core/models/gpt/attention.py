"""Causal self-attention with heads split over the tensor-parallel ranks.

``linear_qkv`` is column-parallel with Megatron's interleaved layout: the full weight's rows are
``[groups, heads/groups + 2 (the group's queries, k, v), head_dim]`` (``[heads, 3, head_dim]``
without grouped-query attention), so a contiguous block of rows is whole groups of heads. ``linear_proj`` is
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

from megatron.core.models.gpt.mup import mup_scales
from megatron.core.models.gpt.norm import Norm
from megatron.core.models.gpt.rotary import RotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import (SITE_ATTENTION_PROBS, DropoutContext,
                                                  attention_dropout_seed, seeded_rng)
from megatron.core.tensor_parallel.utils import divide, tensor_parallel_group


class SelfAttention(torch.nn.Module):
    """Causal self-attention on ``[s, b, h]``; ``layer_number`` is 1-based and global.

    Grouped-query attention: ``num_query_groups`` key/value heads, each shared by
    ``heads / groups`` query heads; ``linear_qkv``'s rows are ``[groups, heads/groups + 2 (the
    group's queries, its key, its value), head_dim]`` (Megatron's layout; with groups = heads it
    is the classic ``[heads, 3, head_dim]``), so a contiguous block of rows is whole groups and a
    TP rank holds ``groups / tp`` of them. ``head_dim`` is --kv-channels (default hidden / heads).
    --qk-layernorm normalises every query and key head (weights shared by all heads, gradients
    summed over TP ranks), then RoPE rotates them.
    """

    def __init__(self, config, layer_number: int, parallel_state, *, init_std: float,
                 output_init_std: float, params_dtype, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.layer_number = layer_number
        self.attention_dropout = config.attention_dropout
        self.num_heads = config.num_attention_heads
        self.head_dim = config.kv_channels or divide(
            config.hidden_size, self.num_heads,
            "hidden-size (must be a multiple of num-attention-heads, or give --kv-channels)")
        groups = config.num_query_groups if config.group_query_attention else self.num_heads
        self.queries_per_group = divide(self.num_heads, groups,
                                        "num-attention-heads (must be a multiple of "
                                        "num-query-groups)")
        self.groups_per_rank = divide(groups, parallel_state.tp_size,
                                      "num-query-groups (must be a multiple of "
                                      "tensor-model-parallel-size)")
        self.heads_per_rank = self.groups_per_rank * self.queries_per_group
        self.tp_rank = parallel_state.tp_rank
        self.first_head = parallel_state.tp_rank * self.heads_per_rank
        bias = not config.disable_bias_linear
        qkv_bias = bias or bool(getattr(config, "add_qkv_bias", False))
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, (self.num_heads + 2 * groups) * self.head_dim, parallel_state,
            bias=qkv_bias, init_std=init_std, sequence_parallel=sequence_parallel,
            params_dtype=params_dtype, device=device)
        self.linear_proj = RowParallelLinear(
            self.num_heads * self.head_dim, config.hidden_size, parallel_state, bias=bias,
            init_std=output_init_std, sequence_parallel=sequence_parallel,
            params_dtype=params_dtype, device=device)
        self.q_layernorm = self.k_layernorm = None
        if getattr(config, "qk_layernorm", False):
            group = tensor_parallel_group(parallel_state)
            self.q_layernorm = Norm(config, params_dtype=params_dtype, device=device,
                                    size=self.head_dim, gradient_group=group)
            self.k_layernorm = Norm(config, params_dtype=params_dtype, device=device,
                                    size=self.head_dim, gradient_group=group)
        self.softmax_scale = mup_scales(config).softmax_scale  # None: 1/sqrt(head_dim)
        self.rotary = None
        if config.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(self.head_dim, config.rotary_percent,
                                          config.rotary_base, config.rotary_interleaved)

    def query_key_value(self, hidden: torch.Tensor, position_offset: int = 0):
        """q ``[s, b, heads/tp, hd]``, k and v ``[s, b, groups/tp, hd]`` (normed and rotated;
        ``position_offset``: position of the first token, for generation with a cache)."""
        qkv = self.linear_qkv(hidden)
        seq_len, batch = qkv.shape[:2]
        qkv = qkv.view(seq_len, batch, self.groups_per_rank, self.queries_per_group + 2,
                       self.head_dim)
        query, key, value = qkv.split([self.queries_per_group, 1, 1], dim=3)
        query = query.reshape(seq_len, batch, self.heads_per_rank, self.head_dim)
        key, value = key.squeeze(3), value.squeeze(3)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if self.rotary is not None:
            query = self.rotary(query, position_offset)
            key = self.rotary(key, position_offset)
        return query, key, value

    def forward(self, hidden: torch.Tensor, dropout: DropoutContext,
                recompute_core: bool = False) -> torch.Tensor:
        query, key, value = self.query_key_value(hidden)
        seq_len, batch = query.shape[:2]
        if self.queries_per_group > 1:  # every query head of a group attends with its key/value
            key = key.repeat_interleave(self.queries_per_group, dim=2)
            value = value.repeat_interleave(self.queries_per_group, dim=2)
        # [s, b, heads/tp, hn] -> [b, heads/tp, s, hn]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if recompute_core:  # selective recomputation: keep only q, k, v, redo the s x s part
            context = checkpoint(self.core_attention, query, key, value, dropout,
                                 use_reentrant=False)
        else:
            context = self.core_attention(query, key, value, dropout)
        # [b, heads/tp, s, hn] -> [s, b, heads/tp * hn]
        context = context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)
        return self.linear_proj(context)

    def core_attention(self, query, key, value, dropout: DropoutContext) -> torch.Tensor:
        """softmax(q k^T / sqrt(hn) + causal mask), dropout, times v; ``[b, heads/tp, s, hn]``
        (with --use-mup the scale is MuP's instead of 1/sqrt(hn))."""
        probability = self.attention_dropout if dropout.enabled else 0.0
        if probability == 0.0:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                  scale=self.softmax_scale)
        if not dropout.layout_invariant_attention:
            seed = attention_dropout_seed(dropout.dropout.seed, self.layer_number, self.tp_rank,
                                          dropout.first_sample)
            with seeded_rng(seed, query.device):
                return F.scaled_dot_product_attention(query, key, value, dropout_p=probability,
                                                      is_causal=True, scale=self.softmax_scale)
        return self.layout_invariant_core_attention(query, key, value, probability, dropout)

    def layout_invariant_core_attention(self, query, key, value, probability: float,
                                        dropout: DropoutContext) -> torch.Tensor:
        """Explicit s x s softmax with counter-based masks (--layout-invariant-attention-dropout)."""
        seq_len = query.shape[2]
        scale = self.softmax_scale if self.softmax_scale is not None else \
            1.0 / math.sqrt(self.head_dim)
        scores = torch.matmul(query, key.transpose(-2, -1)) * scale
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype,
                                                                         torch.float32))
        probs = dropout.dropout.apply(
            probs.to(query.dtype), probability, self.layer_number, SITE_ATTENTION_PROBS,
            dropout.sample_ids, full_shape=(self.num_heads, seq_len, seq_len),
            offsets=(self.first_head, 0, 0))
        return torch.matmul(probs, value)
