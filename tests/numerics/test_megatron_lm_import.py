"""Megatron-LM GPT checkpoints (torch format; legacy ``language_model`` and mcore ``decoder.layers``
layouts; TP 2 x PP 2, local layer numbers per stage) import with the same full weights.

The Megatron-LM files are written here from known full weights following Megatron-LM's naming and
partitioning (Megatron-LM itself is not a dependency)."""

import argparse
import os

import pytest
import torch

from megatron.training.checkpoint_conversion import (
    ConversionError, TargetLayout, merge_full_state, read_checkpoint)
from megatron.training.megatron_lm_import import _partition_dim
from inference_helpers import LLAMA, random_full_weights, tiny_config

torch.set_num_threads(1)
LEGACY = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm",
          "self_attention.linear_qkv": "self_attention.query_key_value",
          "self_attention.linear_proj": "self_attention.dense",
          "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}


def _args(**overrides):
    values = dict(num_layers=4, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                  max_position_embeddings=16, seq_length=16, padded_vocab_size=64,
                  layernorm_epsilon=1e-5, untie_embeddings_and_output_weights=False,
                  openai_gelu=False, tensor_model_parallel_size=2,
                  pipeline_model_parallel_size=2)
    values.update(overrides)
    return argparse.Namespace(**values)


def _stage_names(name, pp_rank, flavour, first_stage_layers=2):
    """The Megatron-LM name of our ``name`` on stage ``pp_rank`` (of 2; the first holds
    ``first_stage_layers`` of the 4 layers), or None."""
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        if (int(index) >= first_stage_layers) != pp_rank:
            return None
        local = int(index) - pp_rank * first_stage_layers
        if flavour == "legacy":
            for ours, theirs in LEGACY.items():
                rest = rest.replace(ours + ".", theirs + ".")
            return f"language_model.encoder.layers.{local}.{rest}"
        rest = rest.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")  # TE
        return f"decoder.layers.{local}.{rest}"
    if name.startswith("decoder.final_layernorm") and pp_rank == 1:
        return ("language_model.encoder." + name[len("decoder."):]) if flavour == "legacy" \
            else name
    if name.startswith("embedding.") and pp_rank == 0:
        return "language_model." + name if flavour == "legacy" else name
    return None


def _nest(flat):
    tree = {}
    for name, value in flat.items():
        parts = name.split(".")
        if parts[0] == "language_model" and parts[1] == "encoder":
            parts = parts[:2] + [".".join(parts[2:])]
        elif parts[0] == "language_model":
            parts = parts[:3] + [".".join(parts[3:])]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _shard(name, value, tp_rank, swiglu):
    """Rank ``tp_rank``'s Megatron-LM shard of our full tensor ``name``."""
    dim = _partition_dim(name)
    if swiglu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        # ours [2, ffn, ...] -> Megatron-LM's per-rank rows [gate_r; up_r]
        block = value.chunk(2, dim=1)[tp_rank]
        return block.reshape(-1, *block.shape[2:]).clone()
    return value if dim is None else value.chunk(2, dim=dim)[tp_rank].clone()


def _write_megatron_lm(root, full, flavour, args=None):
    args = args or _args()
    for tp_rank in range(2):
        for pp_rank in range(2):
            flat = {}
            for name, value in full.items():
                theirs = _stage_names(name, pp_rank, flavour,
                                      getattr(args, "decoder_first_pipeline_num_layers", None) or 2)
                if theirs is None:
                    continue
                flat[theirs] = _shard(name, value, tp_rank, getattr(args, "swiglu", False))
            head = full["embedding.word_embeddings.weight"].chunk(2)[tp_rank].clone()
            if flavour == "legacy":
                model = _nest(flat)
                if pp_rank == 1:
                    model["word_embeddings_for_head"] = {"weight": head}
            else:
                model = dict(flat)
                if pp_rank == 1:
                    model["output_layer.weight"] = head
                model["decoder.layers.0.self_attention.core_attention._extra_state"] = None
            path = os.path.join(root, "iter_0000010", f"mp_rank_{tp_rank:02d}_{pp_rank:03d}",
                                "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path))
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10,
                        "model": model}, path)
    (root / "latest_checkpointed_iteration.txt").write_text("10")


@pytest.mark.parametrize("flavour", ["legacy", "mcore"])
def test_megatron_lm_checkpoint_imports_with_the_same_weights(tmp_path, flavour):
    from tools.convert_checkpoint import main
    config = tiny_config(2, 2)
    full = random_full_weights(config)
    _write_megatron_lm(tmp_path / "mlm", full, flavour)
    assert main(["--load", str(tmp_path / "mlm"), "--save", str(tmp_path / "ours"),
                 "--source-format", "megatron-lm", "--pipeline-model-parallel-size", "2",
                 "--pipeline-schedule", "chimera"]) == 0
    merged = merge_full_state(read_checkpoint(str(tmp_path / "ours")))
    assert merged.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(merged[name], value), name


def test_uneven_stage_megatron_lm_checkpoint_imports_with_the_same_weights(tmp_path):
    """Saved with --decoder-first-pipeline-num-layers 1: stage 1's local layers 0..2 are our
    layers 1..3."""
    from megatron.training.megatron_lm_import import import_megatron_lm
    full = random_full_weights(tiny_config(2, 2))
    _write_megatron_lm(tmp_path / "mlm", full, "mcore",
                       _args(decoder_first_pipeline_num_layers=1))
    import_megatron_lm(str(tmp_path / "mlm"), str(tmp_path / "ours"), TargetLayout())
    merged = merge_full_state(read_checkpoint(str(tmp_path / "ours")))
    assert merged.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(merged[name], value), name


def test_unsupported_megatron_lm_checkpoints_are_refused(tmp_path):
    from megatron.training.megatron_lm_import import import_megatron_lm
    path = tmp_path / "mlm" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    os.makedirs(path.parent)
    torch.save({"args": _args(num_experts=8), "model": {}}, path)
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ConversionError, match="mixture of experts"):
        import_megatron_lm(str(tmp_path / "mlm"), str(tmp_path / "out"), TargetLayout())
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration"):
        import_megatron_lm(str(tmp_path / "none"), str(tmp_path / "out"), TargetLayout())


@pytest.mark.parametrize("flavour", ["legacy", "mcore"])
def test_llama_style_megatron_lm_checkpoint_imports_with_the_same_weights(tmp_path, flavour):
    """RoPE, SwiGLU (Megatron-LM's per-rank [gate; up] rows), RMSNorm, no biases, GQA: the
    options come from the checkpoint's args and the weights arrive unchanged."""
    from megatron.training.megatron_lm_import import import_megatron_lm
    config = tiny_config(2, 2, extra=LLAMA + " --rotary-base 500")
    full = random_full_weights(config)
    full.pop("output_layer.weight")  # the args below tie the output layer to the embedding
    args = _args(position_embedding_type="rope", rotary_base=500, rotary_percent=1.0,
                 swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                 group_query_attention=True, num_query_groups=2, ffn_hidden_size=48,
                 kv_channels=8, add_position_embedding=False, norm_epsilon=1e-5)
    _write_megatron_lm(tmp_path / "mlm", full, flavour, args)
    import_megatron_lm(str(tmp_path / "mlm"), str(tmp_path / "ours"),
                       TargetLayout(tensor_model_parallel_size=2), log=print)
    imported = read_checkpoint(str(tmp_path / "ours"))
    model = imported.config.model
    assert (model.position_embedding_type, model.rotary_base, model.swiglu, model.normalization,
            model.disable_bias_linear, model.num_query_groups) == ("rope", 500, True, "RMSNorm",
                                                                   True, 2)
    merged = merge_full_state(imported)
    assert merged.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(merged[name], value), name
