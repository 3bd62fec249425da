"""Autoregressive generation with a key/value cache on a (tensor-parallel) :class:`GPTModel`.

:func:`forward_with_cache` runs the model's own modules on new tokens only, appending each layer's
keys and values to a :class:`KVCache`, and returns the FULL-vocabulary logits (gathered over the
tensor-parallel group, so every TP rank sees the same numbers and picks the same token).
:func:`generate` does greedy decoding or sampling with temperature, top-k and top-p; sampling draws
from a ``torch.Generator`` seeded identically on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.utils import gather_along_dim


@dataclass
class KVCache:
    """Per-layer ``(keys, values)`` of shape ``[b, groups/tp, positions, head_dim]`` (groups:
    the key/value heads, the attention heads without grouped-query attention)."""

    layers: dict = field(default_factory=dict)
    length: int = 0


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` or ``greedy`` picks the most likely token; else sample from the
    temperature-scaled distribution restricted to the ``top_k`` tokens (0: all) and the smallest
    set whose probability reaches ``top_p`` (1.0: all)."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
            raise ValueError(f"invalid sampling parameters {self}: need temperature >= 0, "
                             f"0 < top_p <= 1, top_k >= 0")


def _attention_with_cache(attention, hidden, cache: KVCache, layer_key,
                          start: int) -> torch.Tensor:
    """The layer's attention over the cached and the new positions (``start``: the first new
    token's position; RoPE rotates by it; grouped-query keys/values are cached per group)."""
    seq_len, batch, _ = hidden.shape
    query, key, value = (t.permute(1, 2, 0, 3)
                         for t in attention.query_key_value(hidden, position_offset=start))
    if layer_key in cache.layers:
        past_key, past_value = cache.layers[layer_key]
        key, value = torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)
    cache.layers[layer_key] = (key, value)
    if attention.queries_per_group > 1:
        key = key.repeat_interleave(attention.queries_per_group, dim=1)
        value = value.repeat_interleave(attention.queries_per_group, dim=1)
    total = key.shape[2]
    query_positions = torch.arange(total - seq_len, total, device=hidden.device)
    visible = torch.arange(total, device=hidden.device)[None, :] <= query_positions[:, None]
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=visible,
                                             scale=attention.softmax_scale)
    context = context.permute(2, 0, 1, 3).reshape(seq_len, batch, -1)
    return attention.linear_proj(context)


@torch.no_grad()
def forward_with_cache(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``[b, s, V_padded]`` of ``tokens`` ``[b, s]`` that follow the ``cache.length``
    cached positions; the cache is extended by ``s`` positions."""
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model (pre_process and post_process); "
                         "load it with megatron.inference.loading.load_model")
    start = cache.length
    if start + tokens.shape[1] > model.config.max_position_embeddings:
        raise ValueError(f"{start + tokens.shape[1]} positions exceed max-position-embeddings "
                         f"{model.config.max_position_embeddings}; shorten the prompt or "
                         f"--max-new-tokens")
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    embedding = model.embedding
    hidden = embedding.word_embeddings(tokens)
    if embedding.position_embeddings is not None:  # learned positions (not RoPE)
        hidden = hidden + embedding.position_embeddings(positions)
    hidden = hidden * embedding.embedding_mult  # 1 unless --use-mup --mup-embedding-mult
    hidden = hidden.transpose(0, 1)  # [s, b, h]
    for key, layer in model.decoder.layers.items():
        hidden = hidden + _attention_with_cache(layer.self_attention,
                                                layer.input_layernorm(hidden), cache, key, start)
        hidden = hidden + layer.mlp(layer.pre_mlp_layernorm(hidden))
    hidden = model.decoder.final_layernorm(hidden)
    weight = embedding.word_embeddings.weight if model.tied_output else None
    logits = model.output_layer(hidden.transpose(0, 1), weight=weight) * model.output_mult
    cache.length = start + tokens.shape[1]
    return gather_along_dim(logits, -1, model.group)


def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, V_padded]`` of the model's ordinary forward pass (no cache), gathered."""
    with torch.no_grad():
        return gather_along_dim(model(tokens), -1, model.group)


def next_token(logits: torch.Tensor, params: SamplingParams, vocab_size: int,
               generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token id per row of ``logits`` ``[b, V_padded]``; padding ids are never chosen."""
    logits = logits.float().clone()
    logits[:, vocab_size:] = float("-inf")
    if params.greedy or params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, vocab_size), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        sorted_logits = sorted_logits.masked_fill(before >= params.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def generate(model, prompt: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
             vocab_size: Optional[int] = None, stop_token: Optional[int] = None) -> list[int]:
    """The ids generated after ``prompt`` (at most ``max_new_tokens``; stops after ``stop_token``).

    Every TP rank must call it with the same arguments; all ranks return the same ids.
    """
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    vocab_size = vocab_size or model.config.padded_vocab_size
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(params.seed)
    cache = KVCache()
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    limit = model.config.max_position_embeddings - len(prompt)
    produced: list[int] = []
    for _ in range(min(max_new_tokens, max(limit, 0))):
        logits = forward_with_cache(model, tokens, cache)[:, -1]
        token = int(next_token(logits, params, vocab_size, generator)[0])
        produced.append(token)
        if token == stop_token:
            break
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)
    return produced
