"""--use-mup: the scales, initial values, forward multipliers and optimizer groups follow
Megatron-LM's MuP formulas (megatron/core/models/gpt/mup.py, megatron/core/optimizer/mup.py), and
--mup-base-hidden-size equal to the hidden size with the standard attention scale reproduces the
standard model and its training step exactly."""

import dataclasses
import math

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.mup import mup_scales, validate_mup_options
from megatron.core.optimizer.mup import mark_mup_parameters, mup_class, split_mup_groups
from megatron.core.optimizer.optimizer import build_param_groups
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args

from pipeline_reference import train_one_step

BASE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8,
            max_position_embeddings=8, padded_vocab_size=64, attention_dropout=0.0,
            hidden_dropout=0.0, init_method_std=0.02)


def config(**overrides):
    return ModelConfig(**{**BASE, **overrides})


def model(model_config, untied=False):
    model_config = dataclasses.replace(model_config, untie_embeddings_and_output_weights=untied)
    return GPTModel(model_config, None, ParallelState.single_process(), 5,
                    params_dtype=torch.float64)


def test_scales_follow_the_formulas():
    scales = mup_scales(config(use_mup=True, mup_base_hidden_size=8))  # m = 4, d = 8, L = 3
    assert scales.width_mult == 4.0
    assert scales.hidden_init_std == pytest.approx(0.02 / 2)
    assert scales.output_init_std == pytest.approx(0.02 / (math.sqrt(6) * 2))
    assert scales.embedding_init_std == 0.02
    assert scales.softmax_scale == pytest.approx(1 / 8)  # 1/d, not 1/sqrt(d)
    assert scales.output_mult == pytest.approx(1 / 4) and scales.embedding_mult == 1.0
    custom = mup_scales(config(use_mup=True, mup_base_hidden_size=8, mup_base_head_dim=4,
                               mup_attn_scale_power=0.5, mup_output_mult=3.0,
                               mup_embedding_mult=10.0))
    assert custom.softmax_scale == pytest.approx(math.sqrt(4) / math.sqrt(8))
    assert (custom.output_mult, custom.embedding_mult) == (3.0, 10.0)
    assert mup_scales(config(use_mup=True)).width_mult == 1.0  # base defaults to the hidden size
    standard = mup_scales(config())
    assert (standard.softmax_scale, standard.output_mult, standard.hidden_init_std) == \
        (None, 1.0, 0.02)


@pytest.mark.parametrize("untied", [False, True])
def test_initial_values_are_the_standard_draws_times_the_mup_factors(untied):
    """Same seed and names: each MuP weight is the standard model's weight times its std ratio
    (the layout-independent initialisation draws from the name only)."""
    standard = dict(model(config(), untied).named_parameters())
    mup = dict(model(config(use_mup=True, mup_base_hidden_size=8), untied).named_parameters())
    assert set(standard) == set(mup)
    for name, value in mup.items():
        if name.endswith(("linear_qkv.weight", "linear_fc1.weight", "linear_proj.weight",
                          "linear_fc2.weight")):
            factor = 0.5  # 1/sqrt(m), for both the hidden and the depth-scaled output init
        else:  # embeddings, untied output layer, norms and biases
            factor = 1.0
        assert torch.allclose(value, standard[name] * factor, rtol=1e-15, atol=0), name


def test_logits_carry_the_output_and_embedding_multipliers():
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    plain = config(use_mup=True, mup_attn_scale_power=0.5)  # m = 1: the standard model
    base_logits = model(plain)(tokens)
    assert torch.allclose(model(config())(tokens), base_logits, rtol=1e-14, atol=0)
    scaled = model(dataclasses.replace(plain, mup_output_mult=0.25))(tokens)
    assert torch.allclose(scaled, base_logits * 0.25, rtol=1e-12, atol=0)
    embedding_scaled = model(dataclasses.replace(plain, mup_embedding_mult=3.0))(tokens)
    assert not torch.allclose(embedding_scaled, base_logits)
    one_over_d = model(config(use_mup=True))(tokens)  # m = 1 still uses MuP's 1/d attention
    assert not torch.allclose(one_over_d, base_logits)


def test_parameter_classes_follow_megatron():
    chunk = model(config(use_mup=True, mup_base_hidden_size=8), untied=True)
    classes = {name: mup_class(name, param) for name, param in chunk.named_parameters()}
    hidden = {name for name, kind in classes.items() if kind == "hidden"}
    assert hidden == {f"decoder.layers.{i}.{part}.weight" for i in range(3) for part in
                      ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")}
    assert classes["embedding.word_embeddings.weight"] == "vector"
    assert classes["embedding.position_embeddings.weight"] == "vector"
    assert classes["output_layer.weight"] == "vector"


def _optimizer_config(optimizer="adam", **extra):
    return parse_args(["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
                       "--lr", "0.01", "--min-lr", "0.001", "--adam-eps", "1e-6",
                       "--optimizer", optimizer, "--train-iters", "1", "--mock-data",
                       "--vocab-size", "64", *extra], world_size=1).optimizer


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_optimizer_groups_follow_the_formulas(optimizer):
    chunk = model(config(use_mup=True, mup_base_hidden_size=8))
    mark_mup_parameters([chunk])
    optimizer_config = _optimizer_config(optimizer)
    groups = split_mup_groups(build_param_groups(chunk.parameters(), 0.1), optimizer_config, 4.0)
    assert sum(len(group["params"]) for group in groups) == len(list(chunk.parameters()))
    for group in groups:
        kinds = {param.mup_class for param in group["params"]}
        assert len(kinds) == 1
        if optimizer == "adam" and kinds == {"hidden"}:
            assert (group["max_lr"], group["min_lr"], group["eps"]) == \
                pytest.approx((0.01 / 4, 0.001 / 4, 1e-6 / 4))
        elif optimizer == "sgd" and kinds == {"vector"}:
            assert (group["max_lr"], group["min_lr"]) == pytest.approx((0.01 * 4, 0.001 * 4))
            assert "eps" not in group
        else:
            assert "max_lr" not in group and "eps" not in group
    assert split_mup_groups(build_param_groups(chunk.parameters(), 0.1), optimizer_config,
                            1.0) == build_param_groups(chunk.parameters(), 0.1)


def test_unmarked_parameters_are_refused():
    chunk = model(config())
    with pytest.raises(ValueError, match="mark_mup_parameters"):
        split_mup_groups(build_param_groups(chunk.parameters(), 0.1), _optimizer_config(), 2.0)


STEP_FLAGS = "--micro-batch-size 2 --global-batch-size 4 --hidden-dropout 0 --attention-dropout 0"


def test_base_equal_to_hidden_with_standard_attention_reproduces_the_standard_step():
    """Megatron: m = 1 leaves init, multipliers and groups alone; only the attention scale is
    MuP's (1/d) unless --mup-attn-scale-power 0.5."""
    standard = train_one_step(0, 1, STEP_FLAGS.split())
    same = train_one_step(0, 1, (STEP_FLAGS + " --use-mup --mup-base-hidden-size 32 "
                                 "--mup-attn-scale-power 0.5").split())
    assert same["loss"] == standard["loss"] and same["grad_norm"] == standard["grad_norm"]
    for key, value in standard["params"].items():
        assert torch.equal(same["params"][key], value), key
    mup = train_one_step(0, 1, (STEP_FLAGS + " --use-mup --mup-base-hidden-size 16").split())
    assert mup["loss"] != standard["loss"]


def test_validation_names_the_fix():
    with pytest.raises(ValueError, match="only act.* with --use-mup"):
        validate_mup_options(config(mup_base_hidden_size=16))
    with pytest.raises(ValueError, match="--mup-base-hidden-size -4 must be positive"):
        validate_mup_options(config(use_mup=True, mup_base_hidden_size=-4))
    with pytest.raises(ValueError, match="--mup-width-mult 3.0 differs"):
        validate_mup_options(config(use_mup=True, mup_base_hidden_size=16, mup_width_mult=3.0))
    validate_mup_options(config(use_mup=True, mup_base_hidden_size=16, mup_width_mult=2.0))


def test_generation_with_a_cache_applies_the_mup_scales():
    from megatron.inference.generation import KVCache, forward_with_cache, full_logits
    chunk = model(config(use_mup=True, mup_base_hidden_size=8, mup_embedding_mult=3.0))
    chunk.eval()
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    cache = KVCache()
    first = forward_with_cache(chunk, tokens[:, :5], cache)
    rest = forward_with_cache(chunk, tokens[:, 5:], cache)
    assert torch.allclose(torch.cat([first, rest], dim=1), full_logits(chunk, tokens),
                          rtol=1e-10, atol=1e-14)


def test_hugging_face_export_refuses_mup_models():
    from megatron.training.hf_conversion import HFConversionError, check_exportable
    from megatron.training.hf_llama import LlamaConversionError, check_llama_exportable
    with pytest.raises(HFConversionError, match="--use-mup"):
        check_exportable(config(use_mup=True))
    llama = config(use_mup=True, position_embedding_type="rope", swiglu=True,
                   normalization="RMSNorm", disable_bias_linear=True)
    with pytest.raises(LlamaConversionError, match="--use-mup"):
        check_llama_exportable(llama)


def test_loading_a_mup_checkpoint_without_the_mup_flags_is_refused():
    from megatron.training.checkpointing.state import CheckpointError, _check_model_flags
    saved = dataclasses.asdict(config(use_mup=True, mup_base_hidden_size=16))
    with pytest.raises(CheckpointError, match="--use-mup True .this run: False"):
        _check_model_flags("ckpt", saved, dataclasses.asdict(config()))
    _check_model_flags("ckpt", saved, dict(saved))
