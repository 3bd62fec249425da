"""Model FLOPs per iteration and throughput per GPU (Megatron-LM's convention).

Convention: *model* FLOPs of forward + backward (backward = 2 x forward), multiply-add = 2 FLOPs,
recomputation NOT counted, causal masking NOT discounted (the full s x s score matrix is counted), the
output layer (logits) counted, embeddings and norms ignored. For plain GPT (multi-head attention,
FFN = 4h, GeLU) this is

    72 * B * s * L * h^2 * (1 + s / (6h) + V / (12 * L * h))

with global batch B, sequence s, layers L, hidden h and padded vocabulary V. The general form below
also covers ``--ffn-hidden-size``, SwiGLU, grouped-query attention and ``--kv-channels``. Throughput per GPU = FLOPs / (iteration seconds * 1e12 * world
size), so a pipeline bubble lowers it; Chimera does no duplicate compute and has 1F1B's FLOPs.
"""

from __future__ import annotations


def gpt_flops_per_iteration(model_config, global_batch_size: int) -> float:
    """Model FLOPs (forward + backward) of one iteration over the global batch."""
    h = model_config.hidden_size
    layers = model_config.num_layers
    s = model_config.seq_length
    vocab = model_config.padded_vocab_size
    ffn = model_config.ffn_hidden_size or 4 * h
    mlp_matrices = 3 if getattr(model_config, "swiglu", False) else 2
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "kv_channels", None) or h // heads
    groups = (model_config.num_query_groups if getattr(model_config, "group_query_attention", False)
              else heads)
    # Forward multiply-adds per token and layer: QKV (h x (heads + 2 groups) x head_dim; 3h^2
    # for plain multi-head attention) + projection (heads x head_dim x h) + MLP + scores and
    # weighted values (2 * s * heads x head_dim).
    attention_width = heads * head_dim
    per_layer = (h * (heads + 2 * groups) * head_dim + attention_width * h
                 + mlp_matrices * h * ffn + 2 * s * attention_width)
    forward_macs_per_token = layers * per_layer + h * vocab
    # x2 FLOPs per multiply-add, x3 for forward + backward.
    return 6.0 * global_batch_size * s * forward_macs_per_token


def throughput_tflops_per_gpu(flops_per_iteration: float, seconds_per_iteration: float,
                              world_size: int) -> float:
    """TFLOP/s per GPU (per process on CPU) for one iteration taking ``seconds_per_iteration``."""
    if seconds_per_iteration <= 0:
        return 0.0
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)
