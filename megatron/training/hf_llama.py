"""Hugging Face Llama export and import of full (merged) weights.

A Llama-style model (``--position-embedding-type rope --swiglu --normalization RMSNorm
--disable-bias-linear``, optionally ``--group-query-attention``, ``--kv-channels``,
``--untie-embeddings-and-output-weights``) maps to ``LlamaForCausalLM``:

===================================================  =============================================
ours                                                 Hugging Face
===================================================  =============================================
embedding.word_embeddings.weight ``[V_pad, h]``      model.embed_tokens.weight ``[V, h]`` (padding cut)
decoder.layers.i.input_layernorm.weight              model.layers.i.input_layernorm.weight
decoder.layers.i.self_attention.linear_qkv.weight    model.layers.i.self_attn.{q,k,v}_proj.weight
  rows ``[groups, heads/groups + 2, hd]``             (q rows ``[heads, hd]``, k and v ``[groups, hd]``)
decoder.layers.i.self_attention.linear_proj.weight   model.layers.i.self_attn.o_proj.weight
decoder.layers.i.pre_mlp_layernorm.weight            model.layers.i.post_attention_layernorm.weight
decoder.layers.i.mlp.linear_fc1.weight ``[2, f, h]``  model.layers.i.mlp.{gate,up}_proj.weight
decoder.layers.i.mlp.linear_fc2.weight               model.layers.i.mlp.down_proj.weight
decoder.final_layernorm.weight                       model.norm.weight
output_layer.weight (untied models only)             lm_head.weight
===================================================  =============================================

Both sides use ``[out, in]`` linear weights and the same rotary convention (the two halves of each
head's channels, ``rotate_half``), so every map is a slice or a concatenation: export followed by
import is exact.
"""

from __future__ import annotations

import torch


class LlamaConversionError(ValueError):
    """A model that is not Llama-shaped; the message names the flag to change."""


def is_llama_style(model_config) -> bool:
    """Whether the model is meant as a Llama (RoPE, SwiGLU and RMSNorm); it may still fail
    :func:`check_llama_exportable` on a detail."""
    return (model_config.position_embedding_type == "rope" and model_config.swiglu
            and model_config.normalization == "RMSNorm")


def check_llama_exportable(model_config) -> None:
    """Raise LlamaConversionError naming every flag ``LlamaForCausalLM`` cannot represent."""
    problems = []
    if model_config.position_embedding_type != "rope":
        problems.append("--position-embedding-type rope is required")
    if model_config.rotary_percent != 1.0 or model_config.rotary_interleaved:
        problems.append("--rotary-percent 1 without --rotary-interleaved is required (Llama "
                        "rotates every channel, halves convention)")
    if not model_config.swiglu:
        problems.append("--swiglu is required")
    if model_config.normalization != "RMSNorm" or model_config.apply_layernorm_1p:
        problems.append("--normalization RMSNorm without --apply-layernorm-1p is required")
    if model_config.qk_layernorm:
        problems.append("--qk-layernorm has no Llama counterpart")
    if getattr(model_config, "use_mup", False):
        problems.append("--use-mup (its attention, embedding and logit scales) has no Llama "
                        "counterpart")
    if not model_config.disable_bias_linear or model_config.add_qkv_bias:
        problems.append("--disable-bias-linear without --add-qkv-bias is required")
    if problems:
        raise LlamaConversionError("this model cannot be exported as a Hugging Face Llama: "
                                   + "; ".join(problems))


def _attention_shape(model_config) -> tuple[int, int, int]:
    """(heads, key/value groups, head dim)."""
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups if model_config.group_query_attention else heads
    head_dim = model_config.kv_channels or model_config.hidden_size // heads
    return heads, groups, head_dim


def ours_to_llama_state(full: dict, model_config, vocab_size: int) -> dict:
    """Our full state dict -> ``LlamaForCausalLM`` tensors (vocabulary padding removed)."""
    check_llama_exportable(model_config)
    heads, groups, head_dim = _attention_shape(model_config)
    per_group = heads // groups
    result = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:vocab_size],
              "model.norm.weight": full["decoder.final_layernorm.weight"]}
    if model_config.untie_embeddings_and_output_weights:
        result["lm_head.weight"] = full["output_layer.weight"][:vocab_size]
    for index in range(model_config.num_layers):
        ours, hf = f"decoder.layers.{index}.", f"model.layers.{index}."
        qkv = full[f"{ours}self_attention.linear_qkv.weight"]
        qkv = qkv.reshape(groups, per_group + 2, head_dim, qkv.shape[-1])
        fc1 = full[f"{ours}mlp.linear_fc1.weight"]
        result.update({
            f"{hf}input_layernorm.weight": full[f"{ours}input_layernorm.weight"],
            f"{hf}self_attn.q_proj.weight": qkv[:, :per_group].reshape(heads * head_dim, -1),
            f"{hf}self_attn.k_proj.weight": qkv[:, per_group].reshape(groups * head_dim, -1),
            f"{hf}self_attn.v_proj.weight": qkv[:, per_group + 1].reshape(groups * head_dim, -1),
            f"{hf}self_attn.o_proj.weight": full[f"{ours}self_attention.linear_proj.weight"],
            f"{hf}post_attention_layernorm.weight": full[f"{ours}pre_mlp_layernorm.weight"],
            f"{hf}mlp.gate_proj.weight": fc1[0],
            f"{hf}mlp.up_proj.weight": fc1[1],
            f"{hf}mlp.down_proj.weight": full[f"{ours}mlp.linear_fc2.weight"],
        })
    return {name: value.contiguous().clone() for name, value in result.items()}


def llama_to_ours_state(hf_state: dict, model_config) -> dict:
    """``LlamaForCausalLM`` tensors -> our full state dict (vocabulary zero-padded)."""
    heads, groups, head_dim = _attention_shape(model_config)
    per_group = heads // groups
    padded = model_config.padded_vocab_size

    def get(name):
        if name not in hf_state:
            raise LlamaConversionError(f"the Hugging Face weights have no {name}; is this a "
                                       f"LlamaForCausalLM of {model_config.num_layers} layers?")
        return hf_state[name]

    def pad_vocab(value):
        return torch.cat([value, value.new_zeros(padded - value.shape[0], value.shape[1])])

    result = {"embedding.word_embeddings.weight": pad_vocab(get("model.embed_tokens.weight")),
              "decoder.final_layernorm.weight": get("model.norm.weight")}
    if model_config.untie_embeddings_and_output_weights:
        result["output_layer.weight"] = pad_vocab(get("lm_head.weight"))
    for index in range(model_config.num_layers):
        ours, hf = f"decoder.layers.{index}.", f"model.layers.{index}."
        query = get(f"{hf}self_attn.q_proj.weight")
        hidden = query.shape[-1]
        qkv = torch.cat([query.reshape(groups, per_group, head_dim, hidden),
                         get(f"{hf}self_attn.k_proj.weight").reshape(groups, 1, head_dim, hidden),
                         get(f"{hf}self_attn.v_proj.weight").reshape(groups, 1, head_dim, hidden)],
                        dim=1)
        result.update({
            f"{ours}input_layernorm.weight": get(f"{hf}input_layernorm.weight"),
            f"{ours}self_attention.linear_qkv.weight": qkv.reshape(-1, hidden),
            f"{ours}self_attention.linear_proj.weight": get(f"{hf}self_attn.o_proj.weight"),
            f"{ours}pre_mlp_layernorm.weight": get(f"{hf}post_attention_layernorm.weight"),
            f"{ours}mlp.linear_fc1.weight": torch.stack([get(f"{hf}mlp.gate_proj.weight"),
                                                        get(f"{hf}mlp.up_proj.weight")]),
            f"{ours}mlp.linear_fc2.weight": get(f"{hf}mlp.down_proj.weight"),
        })
    return {name: value.contiguous().clone() for name, value in result.items()}


def llama_config_dict(model_config, vocab_size: int) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` equal to our model."""
    heads, groups, head_dim = _attention_shape(model_config)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": model_config.hidden_size,
        "intermediate_size": model_config.ffn_hidden_size or 4 * model_config.hidden_size,
        "num_hidden_layers": model_config.num_layers, "num_attention_heads": heads,
        "num_key_value_heads": groups, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": (model_config.max_position_embeddings
                                    or model_config.seq_length),
        "rms_norm_eps": model_config.layernorm_epsilon,
        "rope_theta": float(model_config.rotary_base),
        "attention_bias": False, "mlp_bias": False,
        "attention_dropout": model_config.attention_dropout,
        "initializer_range": model_config.init_method_std,
        "tie_word_embeddings": not model_config.untie_embeddings_and_output_weights,
        "torch_dtype": "float32",
    }


def model_flags_from_llama(config: dict) -> list[str]:
    """Our model flags equal to a Hugging Face Llama ``config.json``; raise for what we lack."""
    if config.get("hidden_act", "silu") != "silu":
        raise LlamaConversionError(f"hidden_act {config['hidden_act']!r} is not supported; "
                                   f"Llama's SwiGLU uses silu")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise LlamaConversionError("attention_bias / mlp_bias are not supported (Llama-style "
                                   "models here are bias-free)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise LlamaConversionError(f"rope type {rope.get('rope_type', rope.get('type'))!r} is "
                                   f"not supported; only the default rotary embedding is")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    flags = ["--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads),
             "--ffn-hidden-size", str(config["intermediate_size"]),
             "--max-position-embeddings", str(config["max_position_embeddings"]),
             "--layernorm-epsilon", repr(config.get("rms_norm_eps", 1e-6)),
             "--attention-dropout", repr(float(config.get("attention_dropout", 0.0))),
             "--hidden-dropout", "0.0",
             "--init-method-std", repr(config.get("initializer_range", 0.02)),
             "--position-embedding-type", "rope", "--rotary-base", str(int(theta)),
             "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]
    if float(theta) != int(theta):
        raise LlamaConversionError(f"rope_theta {theta} is not an integer (--rotary-base is)")
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if head_dim * heads != hidden:
        flags += ["--kv-channels", str(head_dim)]
    if config.get("tie_word_embeddings", False) is False:
        flags.append("--untie-embeddings-and-output-weights")
    return flags
