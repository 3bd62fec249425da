"""Hugging Face GPT-2 export and import of full (merged) weights (Llama: :mod:`megatron.training.hf_llama`).

Our names and shapes (see :mod:`megatron.core.models.gpt`) map to ``GPT2LMHeadModel``'s:

====================================================  ============================================
ours (``[out, in]`` linear weights)                   Hugging Face (``Conv1D``: ``[in, out]``)
====================================================  ============================================
embedding.word_embeddings.weight ``[V_pad, h]``       transformer.wte.weight ``[V, h]`` (padding cut)
embedding.position_embeddings.weight                  transformer.wpe.weight
decoder.layers.i.input_layernorm.{weight,bias}        transformer.h.i.ln_1.{weight,bias}
decoder.layers.i.self_attention.linear_qkv            transformer.h.i.attn.c_attn (transposed; rows
                                                      ``[heads, 3, hd]`` <-> columns ``[3, heads, hd]``)
decoder.layers.i.self_attention.linear_proj           transformer.h.i.attn.c_proj (transposed)
decoder.layers.i.pre_mlp_layernorm                    transformer.h.i.ln_2
decoder.layers.i.mlp.linear_fc1 / linear_fc2          transformer.h.i.mlp.c_fc / c_proj (transposed)
decoder.final_layernorm                               transformer.ln_f
output_layer.weight (untied models only)              lm_head.weight
====================================================  ============================================

Every map here is a permutation or transpose, so export followed by import is exact. The GeLU of
Hugging Face's ``gelu_new`` is our ``--openai-gelu`` (tanh approximation); ``gelu`` is the exact one.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

HF_WEIGHTS_FILE = "model.safetensors"
GELU_BY_FLAG = {False: "gelu", True: "gelu_new"}
SUPPORTED_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


class HFConversionError(ValueError):
    """A model that cannot be converted to or from Hugging Face; the message names the fix."""


def _qkv_ours_to_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``[heads, 3, hd]`` (ours) -> rows ``[3, heads, hd]`` (Hugging Face), same trailing dims."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // (3 * heads)
    return weight.reshape(heads, 3, head_dim, *rest).transpose(0, 1).reshape(weight.shape)


def _qkv_hf_to_ours(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // (3 * heads)
    return weight.reshape(3, heads, head_dim, *rest).transpose(0, 1).reshape(weight.shape)


def _layer_pairs(index: int) -> list[tuple[str, str, str]]:
    """(our name, Hugging Face name, kind) of one transformer layer's tensors."""
    ours, hf = f"decoder.layers.{index}.", f"transformer.h.{index}."
    pairs = []
    for norm_ours, norm_hf in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
        pairs += [(f"{ours}{norm_ours}.{p}", f"{hf}{norm_hf}.{p}", "copy") for p in ("weight", "bias")]
    for linear_ours, linear_hf, kind in (
            ("self_attention.linear_qkv", "attn.c_attn", "qkv"),
            ("self_attention.linear_proj", "attn.c_proj", "linear"),
            ("mlp.linear_fc1", "mlp.c_fc", "linear"), ("mlp.linear_fc2", "mlp.c_proj", "linear")):
        pairs.append((f"{ours}{linear_ours}.weight", f"{hf}{linear_hf}.weight", kind))
        pairs.append((f"{ours}{linear_ours}.bias", f"{hf}{linear_hf}.bias",
                      "qkv_bias" if kind == "qkv" else "copy"))
    return pairs


def name_pairs(num_layers: int, tied: bool) -> list[tuple[str, str, str]]:
    """Every (our name, Hugging Face name, kind) of a GPT-2 with ``num_layers`` layers."""
    pairs = [("embedding.word_embeddings.weight", "transformer.wte.weight", "vocab"),
             ("embedding.position_embeddings.weight", "transformer.wpe.weight", "copy")]
    for index in range(num_layers):
        pairs += _layer_pairs(index)
    pairs += [("decoder.final_layernorm.weight", "transformer.ln_f.weight", "copy"),
              ("decoder.final_layernorm.bias", "transformer.ln_f.bias", "copy")]
    if not tied:
        pairs.append(("output_layer.weight", "lm_head.weight", "vocab"))
    return pairs


def check_exportable(model_config) -> None:
    """Raise HFConversionError when the model is not a GPT-2 that ``GPT2LMHeadModel`` can hold."""
    problems = []
    if model_config.normalization != "LayerNorm":
        problems.append("--normalization RMSNorm (GPT-2 uses LayerNorm)")
    if model_config.disable_bias_linear:
        problems.append("--disable-bias-linear (GPT-2's linear layers have biases)")
    if model_config.swiglu or model_config.position_embedding_type != "learned_absolute":
        problems.append("--swiglu / rope (GPT-2 has a GeLU MLP and learned positions)")
    others = [flag for flag, used in (
        ("--use-mup", getattr(model_config, "use_mup", False)),
        ("--squared-relu", model_config.squared_relu),
        ("--no-position-embedding", model_config.no_position_embedding),
        ("--apply-layernorm-1p", model_config.apply_layernorm_1p),
        ("--qk-layernorm", model_config.qk_layernorm),
        ("--add-qkv-bias", model_config.add_qkv_bias),
        ("--group-query-attention", model_config.group_query_attention),
        ("--kv-channels", model_config.kv_channels is not None and
         model_config.kv_channels * model_config.num_attention_heads != model_config.hidden_size),
    ) if used]
    if others:
        problems.append(f"{', '.join(others)} (GPT-2 has none of these)")
    if problems:
        raise HFConversionError(f"this model cannot be exported as a Hugging Face GPT-2: "
                                f"{'; '.join(problems)}; export only GPT-2-shaped models (or "
                                f"Llama-style ones: rope + --swiglu + --normalization RMSNorm "
                                f"export as LlamaForCausalLM)")


def ours_to_hf_state(full: dict, model_config, vocab_size: int) -> dict:
    """Our full state dict -> ``GPT2LMHeadModel`` tensors (rows past ``vocab_size``, the
    vocabulary padding, removed)."""
    check_exportable(model_config)
    tied = not model_config.untie_embeddings_and_output_weights
    vocab = vocab_size
    heads = model_config.num_attention_heads
    result = {}
    for ours, hf, kind in name_pairs(model_config.num_layers, tied):
        if ours not in full:
            raise HFConversionError(f"the checkpoint has no {ours}; it is not a GPT-2 of "
                                    f"{model_config.num_layers} layers")
        value = full[ours]
        if kind == "vocab":
            value = value[:vocab]
        elif kind == "qkv":
            value = _qkv_ours_to_hf(value, heads).t()
        elif kind == "qkv_bias":
            value = _qkv_ours_to_hf(value, heads)
        elif kind == "linear":
            value = value.t()
        result[hf] = value.contiguous().clone()
    return result


def hf_to_ours_state(hf_state: dict, model_config) -> dict:
    """``GPT2LMHeadModel`` tensors -> our full state dict; the vocabulary is zero-padded to
    ``model_config.padded_vocab_size``."""
    tied = not model_config.untie_embeddings_and_output_weights
    heads = model_config.num_attention_heads
    padded = model_config.padded_vocab_size
    result = {}
    for ours, hf, kind in name_pairs(model_config.num_layers, tied):
        if hf not in hf_state:
            raise HFConversionError(f"the Hugging Face weights have no {hf}; is this a "
                                    f"GPT2LMHeadModel of {model_config.num_layers} layers?")
        value = hf_state[hf]
        if kind == "vocab":
            pad = value.new_zeros(padded - value.shape[0], value.shape[1])
            value = torch.cat([value, pad])
        elif kind == "qkv":
            value = _qkv_hf_to_ours(value.t(), heads)
        elif kind == "qkv_bias":
            value = _qkv_hf_to_ours(value, heads)
        elif kind == "linear":
            value = value.t()
        result[ours] = value.contiguous().clone()
    return result


def hf_config_dict(model_config, vocab_size: int) -> dict:
    """``config.json`` of a ``GPT2LMHeadModel`` equal to our model (dropouts kept)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model_config.max_position_embeddings or model_config.seq_length,
        "n_embd": model_config.hidden_size, "n_layer": model_config.num_layers,
        "n_head": model_config.num_attention_heads,
        "n_inner": model_config.ffn_hidden_size or 4 * model_config.hidden_size,
        "activation_function": GELU_BY_FLAG[bool(getattr(model_config, "openai_gelu", False))],
        "resid_pdrop": model_config.hidden_dropout, "embd_pdrop": model_config.hidden_dropout,
        "attn_pdrop": model_config.attention_dropout,
        "layer_norm_epsilon": model_config.layernorm_epsilon,
        "initializer_range": model_config.init_method_std,
        "tie_word_embeddings": not model_config.untie_embeddings_and_output_weights,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "torch_dtype": "float32",
    }


def write_hf_directory(out_dir: str, hf_state: dict, hf_config: dict, tokenizer_files=()) -> None:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files into ``out_dir``."""
    from safetensors.torch import save_file

    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise HFConversionError(f"{out_dir} is not empty; choose an empty --save directory")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as handle:
        json.dump(hf_config, handle, indent=2)
    save_file(hf_state, os.path.join(out_dir, HF_WEIGHTS_FILE), metadata={"format": "pt"})
    for source, name in tokenizer_files:
        shutil.copyfile(source, os.path.join(out_dir, name))


def read_hf_directory(hf_dir: str) -> tuple[dict, dict]:
    """(``config.json`` as a dict, tensors) of a local Hugging Face GPT-2 directory."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise HFConversionError(f"{hf_dir} has no config.json; point --load at a local Hugging "
                                f"Face model directory (e.g. one saved with save_pretrained)")
    with open(config_path) as handle:
        config = json.load(handle)
    if config.get("model_type") not in ("gpt2", "llama"):
        raise HFConversionError(f"{hf_dir} holds a {config.get('model_type')!r} model; only "
                                f"GPT-2 and Llama (model_type 'gpt2' or 'llama') can be "
                                f"imported")
    safetensors_path = os.path.join(hf_dir, HF_WEIGHTS_FILE)
    bin_path = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file
        state = load_file(safetensors_path)
    elif os.path.isfile(bin_path):
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    else:
        raise HFConversionError(f"{hf_dir} has neither {HF_WEIGHTS_FILE} nor pytorch_model.bin")
    if config["model_type"] == "gpt2":
        # GPT2Model (no LM head) checkpoints name tensors without the "transformer." prefix
        state = {(name if name.startswith(("transformer.", "lm_head.")) else
                  f"transformer.{name}"): value for name, value in state.items()}
    return config, state


def model_flags_from_hf(config: dict) -> list[str]:
    """Our model flags equal to a Hugging Face GPT-2 ``config.json``; raise for what we lack."""
    activation = config.get("activation_function", "gelu_new")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise HFConversionError(f"activation_function {activation!r} is not supported; "
                                f"use one of {sorted(SUPPORTED_ACTIVATIONS)}")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise HFConversionError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are "
                                "not supported; import a standard GPT-2")
    if config.get("scale_attn_weights", True) is False:
        raise HFConversionError("scale_attn_weights=false is not supported (we scale by "
                                "1/sqrt(head_dim))")
    hidden = config["n_embd"]
    flags = ["--num-layers", str(config["n_layer"]), "--hidden-size", str(hidden),
             "--num-attention-heads", str(config["n_head"]),
             "--ffn-hidden-size", str(config.get("n_inner") or 4 * hidden),
             "--max-position-embeddings", str(config["n_positions"]),
             "--layernorm-epsilon", repr(config.get("layer_norm_epsilon", 1e-5)),
             "--attention-dropout", repr(config.get("attn_pdrop", 0.1)),
             "--hidden-dropout", repr(config.get("resid_pdrop", 0.1)),
             "--init-method-std", repr(config.get("initializer_range", 0.02))]
    if SUPPORTED_ACTIVATIONS[activation]:
        flags.append("--openai-gelu")
    if config.get("tie_word_embeddings", True) is False:
        flags.append("--untie-embeddings-and-output-weights")
    return flags
