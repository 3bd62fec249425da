"""The modern block's options against an independent batch-first reference (one process, float64).

The reference below is written from the definitions, not from the model's code: RoPE as complex
rotation of channel pairs (neighbours with --rotary-interleaved, halves otherwise), grouped-query
attention by indexing each head's group, explicit norms. Loss and every gradient must agree to
1e-10 relative (dropout off; only summation order differs). The Llama combination is also checked
against transformers' LlamaForCausalLM in tests/numerics/test_hf_conversion.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ModelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState

VOCAB = 64
SEED = 77


def _norm(x, weight, bias, config):
    weight = weight + 1.0 if config.apply_layernorm_1p else weight
    if config.normalization == "RMSNorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * weight
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + config.layernorm_epsilon) * weight + bias


def _rope(x, config):
    """x [b, s, heads, d]: rotate channel pairs as complex numbers by position x frequency."""
    d = x.shape[-1]
    rotated = int(d * config.rotary_percent)
    part, rest = x[..., :rotated], x[..., rotated:]
    if config.rotary_interleaved:
        real, imag = part[..., 0::2], part[..., 1::2]
    else:
        real, imag = part[..., :rotated // 2], part[..., rotated // 2:]
    frequencies = torch.tensor([config.rotary_base ** (-2 * i / rotated)
                                for i in range(rotated // 2)], dtype=torch.float64)
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * frequencies  # [s, r/2]
    turned = torch.complex(real, imag) * torch.polar(torch.ones_like(angle), angle)[None, :, None]
    if config.rotary_interleaved:
        part = torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)
    else:
        part = torch.cat([turned.real, turned.imag], dim=-1)
    return torch.cat([part, rest], dim=-1)


def reference_loss(p, config, tokens, labels):
    """Per-token loss [b, s] of the model described by ``config`` with parameters ``p``."""
    batch, seq = tokens.shape
    heads = config.num_attention_heads
    groups = config.num_query_groups if config.group_query_attention else heads
    d = config.kv_channels or config.hidden_size // heads
    x = p["embedding.word_embeddings.weight"][tokens]
    if config.position_embedding_type == "learned_absolute" and not config.no_position_embedding:
        x = x + p["embedding.position_embeddings.weight"][:seq]
    for layer in range(config.num_layers):
        name = f"decoder.layers.{layer}."
        get = lambda key: p.get(name + key)  # noqa: E731
        h = _norm(x, get("input_layernorm.weight"), get("input_layernorm.bias"), config)
        qkv = h @ get("self_attention.linear_qkv.weight").T
        if get("self_attention.linear_qkv.bias") is not None:
            qkv = qkv + get("self_attention.linear_qkv.bias")
        qkv = qkv.view(batch, seq, groups, heads // groups + 2, d)
        q = qkv[:, :, :, :heads // groups].reshape(batch, seq, heads, d)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [b, s, groups, d]
        if config.qk_layernorm:
            q = _norm(q, get("self_attention.q_layernorm.weight"),
                      get("self_attention.q_layernorm.bias"), config)
            k = _norm(k, get("self_attention.k_layernorm.weight"),
                      get("self_attention.k_layernorm.bias"), config)
        if config.position_embedding_type == "rope":
            q, k = _rope(q, config), _rope(k, config)
        group_of_head = torch.arange(heads) // (heads // groups)
        k, v = k[:, :, group_of_head], v[:, :, group_of_head]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        context = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, heads * d)
        out = context @ get("self_attention.linear_proj.weight").T
        if get("self_attention.linear_proj.bias") is not None:
            out = out + get("self_attention.linear_proj.bias")
        x = x + out
        h = _norm(x, get("pre_mlp_layernorm.weight"), get("pre_mlp_layernorm.bias"), config)
        fc1, fc1_bias = get("mlp.linear_fc1.weight"), get("mlp.linear_fc1.bias")
        if config.swiglu:
            gate, up = h @ fc1[0].T, h @ fc1[1].T
            if fc1_bias is not None:
                gate, up = gate + fc1_bias[0], up + fc1_bias[1]
            h = gate * torch.sigmoid(gate) * up
        else:
            h = h @ fc1.T + (0 if fc1_bias is None else fc1_bias)
            h = torch.clamp(h, min=0) ** 2 if config.squared_relu else \
                0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        out = h @ get("mlp.linear_fc2.weight").T
        if get("mlp.linear_fc2.bias") is not None:
            out = out + get("mlp.linear_fc2.bias")
        x = x + out
    x = _norm(x, p["decoder.final_layernorm.weight"], p.get("decoder.final_layernorm.bias"),
              config)
    output = p.get("output_layer.weight", p["embedding.word_embeddings.weight"])
    logits = x @ output.T
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                           reduction="none").view(batch, seq)


LLAMA = dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
             disable_bias_linear=True, group_query_attention=True, num_query_groups=2)
CASES = {
    "llama": LLAMA,
    "llama-untied-kv-channels": dict(LLAMA, untie_embeddings_and_output_weights=True,
                                     kv_channels=16, rotary_base=500),
    "partial-interleaved-rope-squared-relu": dict(
        position_embedding_type="rope", rotary_percent=0.5, rotary_interleaved=True,
        squared_relu=True),
    "qk-layernorm-1p-qkv-bias": dict(qk_layernorm=True, apply_layernorm_1p=True,
                                     disable_bias_linear=True, add_qkv_bias=True,
                                     kv_channels=12),
    "rmsnorm-1p-qk-no-positions": dict(normalization="RMSNorm", apply_layernorm_1p=True,
                                       qk_layernorm=True, no_position_embedding=True),
    "swiglu-with-biases": dict(swiglu=True, position_embedding_type="none"),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_model_matches_the_independent_reference(overrides):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=12,
                         max_position_embeddings=12, padded_vocab_size=VOCAB, ffn_hidden_size=40,
                         attention_dropout=0.0, hidden_dropout=0.0, **overrides)
    model = GPTModel(config, None, ParallelState.single_process(), SEED,
                     params_dtype=torch.float64)
    with torch.no_grad():  # move every parameter (norms and biases too) away from its init
        generator = torch.Generator().manual_seed(3)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.1)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=generator)
    labels = torch.randint(0, VOCAB, (3, 12), generator=generator)
    loss = model(tokens, labels)
    loss.mean().backward()
    params = {name: param.detach().clone().requires_grad_()
              for name, param in model.named_parameters()}
    expected = reference_loss(params, config, tokens, labels)
    expected.mean().backward()
    assert torch.allclose(loss, expected, rtol=1e-10, atol=0), (loss - expected).abs().max()
    for name, param in model.named_parameters():
        want = params[name].grad
        # (the key norm's bias shifts every score of a query equally: its true gradient is 0 and
        # both sides give rounding noise, hence the absolute floor)
        error = (param.grad - want).abs().max() / max(float(want.abs().max()), 1e-6)
        assert error < 1e-10, (name, float(error))
