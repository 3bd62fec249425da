"""Hugging Face GPT-2 export and import: a Chimera PP4 and a TP2 checkpoint load in
``transformers`` with our logits (float32, 1e-5); a random ``GPT2LMHeadModel`` imports with its
logits; export after import gives back the same tensors exactly."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from megatron.inference.generation import full_logits
from megatron.inference.loading import load_model, model_from_full_state
from megatron.training.checkpoint_conversion import (
    ConversionError, TargetLayout, merge_full_state, read_checkpoint)
from megatron.training.hf_checkpoint import export_to_hf, import_from_hf
from megatron.training.hf_conversion import HFConversionError, check_exportable
from inference_helpers import LLAMA, VOCAB, random_full_weights, tiny_config, write_checkpoint

torch.set_num_threads(1)
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def assert_export_reproduces_the_import(tmp_path) -> None:
    """Exporting tmp_path/ckpt (imported from tmp_path/hf) writes the imported tensors bit-exactly."""
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), log=print)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for name, value in original.items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize("layout,extra", [((1, 4, "chimera"), ""), ((2, 1, None), "--openai-gelu")],
                         ids=["chimera-pp4", "tp2-openai-gelu"])
def test_export_loads_in_transformers_with_our_logits(tmp_path, layout, extra):
    config = tiny_config(*layout, extra=extra)
    full = random_full_weights(config)
    write_checkpoint(tmp_path / "ckpt", config, full)
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), log=print)

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["vocab_size"] == VOCAB  # the padding (to 64) is cut
    assert hf_config["activation_function"] == ("gelu_new" if extra else "gelu")
    hf_model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
    ours = full_logits(model_from_full_state(full, tiny_config(extra=extra)), TOKENS)[..., :VOCAB]
    assert theirs.dtype == ours.dtype == torch.float32
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert ours.abs().max() > 0.1  # not a trivially zero model


def _random_gpt2(tmp_path, **overrides):
    settings = dict(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                    bos_token_id=49, eos_token_id=49)
    settings.update(overrides)
    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(**settings)).eval()
    with torch.no_grad():  # biases and LayerNorms away from their 0 / 1 initial values
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(str(tmp_path / "hf"))
    return model


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_import_random_gpt2_gives_its_logits_and_round_trips_exactly(tmp_path, untie):
    hf_model = _random_gpt2(tmp_path, tie_word_embeddings=not untie)
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                   TargetLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                   make_vocab_size_divisible_by=8, log=print)
    model, config = load_model(str(tmp_path / "ckpt"))
    assert config.model.openai_gelu and config.model.padded_vocab_size == 64
    assert config.model.untie_embeddings_and_output_weights == untie
    tokens = TOKENS % 50
    with torch.no_grad():
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(full_logits(model, tokens)[..., :50], theirs, atol=1e-5, rtol=0)

    assert_export_reproduces_the_import(tmp_path)


def test_import_refuses_unsupported_models(tmp_path):
    _random_gpt2(tmp_path, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ConversionError, match="scale_attn_by_inverse_layer_idx"):
        import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), TargetLayout(), log=print)
    with pytest.raises(ConversionError, match="no config.json"):
        import_from_hf(str(tmp_path / "nothing"), str(tmp_path / "ckpt2"), TargetLayout(),
                       log=print)
    rms = dataclasses.replace(tiny_config().model, normalization="RMSNorm")
    with pytest.raises(HFConversionError, match="RMSNorm"):
        check_exportable(rms)


def test_cli_exports_and_imports(tmp_path):
    from tools.convert_checkpoint import main
    config = tiny_config(1, 2)
    full = random_full_weights(config)
    write_checkpoint(tmp_path / "ckpt", config, full)
    assert main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf"),
                 "--target-format", "hf"]) == 0
    assert main(["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "back"),
                 "--source-format", "hf", "--make-vocab-size-divisible-by", "32",
                 "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera"]) == 0
    merged = merge_full_state(read_checkpoint(str(tmp_path / "back")))
    assert merged.keys() == full.keys()
    for name, value in full.items():
        if name == "embedding.word_embeddings.weight":  # export cuts the padding, import zeroes it
            assert torch.equal(merged[name][:VOCAB], value[:VOCAB])
            assert not merged[name][VOCAB:].any()
        else:
            assert torch.equal(merged[name], value), name
    assert main(["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf"),
                 "--target-format", "hf"]) == 1  # not empty


def test_imported_gpt2_fine_tunes_with_the_printed_flags(tmp_path):
    import pretrain_gpt
    from megatron.core.parallel_state import ParallelState
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import Checkpointer
    from megatron.training.training import pretrain
    _random_gpt2(tmp_path)
    lines = []
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), TargetLayout(),
                   make_vocab_size_divisible_by=8, log=lines.append)
    flags = lines[-1].split("--finetune ", 1)[1].split()
    assert "--openai-gelu" in flags
    config = parse_args(flags + f"--micro-batch-size 1 --global-batch-size 2 --lr 1e-3 "
                                f"--train-iters 1 --eval-iters 0 --load {tmp_path / 'ckpt'} "
                                f"--finetune".split())
    log = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      checkpointing=Checkpointer(config, log=log.append), log=log.append)
    assert any("successfully loaded" in line for line in log)
    assert math.isfinite(result.history[-1].losses["lm loss"])


# ---- Llama (issue 27) -------------------------------------------------------------------------

@pytest.mark.parametrize("layout,extra", [
    ((2, 1, None), ""), ((1, 2, "chimera"), "--kv-channels 16 --rotary-base 500"),
    ((2, 2, "chimera"), "--group-query-attention --num-query-groups 4")],
    ids=["tp2-gqa2", "chimera-pp2-kv-channels", "chimera-tp2xpp2-groups-equal-heads"])
def test_llama_export_loads_in_transformers_with_our_logits(tmp_path, layout, extra):
    from transformers import LlamaForCausalLM
    config = tiny_config(*layout, extra=f"{LLAMA} {extra}")
    full = random_full_weights(config, scale=0.2)
    write_checkpoint(tmp_path / "ckpt", config, full)
    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), log=print)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "llama" and hf_config["vocab_size"] == VOCAB
    hf_model = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf_model(TOKENS).logits
    ours = full_logits(model_from_full_state(full, tiny_config(extra=f"{LLAMA} {extra}")),
                       TOKENS)[..., :VOCAB]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    assert ours.abs().max() > 0.1

    # import back (into another layout): the same tensors exactly
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "back"),
                   TargetLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                pipeline_schedule="chimera"),
                   seq_length=16, make_vocab_size_divisible_by=32, log=print)
    merged = merge_full_state(read_checkpoint(str(tmp_path / "back")))
    assert merged.keys() == full.keys()
    for name, value in full.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(merged[name][:VOCAB], value[:VOCAB]), name
        else:
            assert torch.equal(merged[name], value), name


def test_random_llama_imports_with_its_logits_and_round_trips_exactly(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(5)
    hf_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=1000.0)).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf_model.save_pretrained(str(tmp_path / "hf"))
    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                   TargetLayout(tensor_model_parallel_size=2), make_vocab_size_divisible_by=8,
                   log=print)
    model, config = load_model(str(tmp_path / "ckpt"))
    assert config.model.group_query_attention and config.model.num_query_groups == 2
    assert config.model.rotary_base == 1000 and config.model.swiglu
    tokens = TOKENS % 50
    with torch.no_grad():
        theirs = hf_model(tokens).logits
    torch.testing.assert_close(full_logits(model, tokens)[..., :50], theirs, atol=1e-4, rtol=0)
    assert_export_reproduces_the_import(tmp_path)


def test_models_neither_gpt2_nor_llama_are_refused_with_the_flag_to_change(tmp_path):
    config = tiny_config(extra=f"{LLAMA} --qk-layernorm")
    write_checkpoint(tmp_path / "ckpt", config, random_full_weights(config))
    with pytest.raises(ConversionError, match="--qk-layernorm has no Llama counterpart"):
        export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), log=print)
    gqa = dataclasses.replace(tiny_config().model, group_query_attention=True, num_query_groups=2)
    with pytest.raises(HFConversionError, match="--group-query-attention"):
        check_exportable(gqa)
