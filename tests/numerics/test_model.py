"""GPT model numerics in one process (float64): reference forward, pipeline chunks, recomputation, init.

The reference is a plain-PyTorch GPT-2 written here from the architecture (batch-first layout, no
tensor-parallel layers), fed the model's own weights by name; dropout masks come from the
documented formula (seed, layer number, site, sample id, full-tensor coordinates).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ModelConfig, RecomputeConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState, RankLayout
from megatron.core.tensor_parallel.random import (
    SITE_ATTENTION_OUTPUT, SITE_ATTENTION_PROBS, SITE_EMBEDDING, SITE_MLP_OUTPUT,
    CounterBasedDropout, stable_seed)

SEED = 1234
VOCAB = 96


def make_config(**overrides) -> ModelConfig:
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=12,
                  max_position_embeddings=16, padded_vocab_size=VOCAB, attention_dropout=0.1,
                  hidden_dropout=0.1, layout_invariant_attention_dropout=True)
    values.update(overrides)
    return ModelConfig(**values)


def make_batch(batch=3, seq=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    return tokens, labels


def build(config, recompute=None, **kwargs):
    return GPTModel(config, recompute or RecomputeConfig(), ParallelState.single_process(), SEED,
                    params_dtype=torch.float64, **kwargs)


def reference_loss(params, config, tokens, labels, sample_ids, dropout_on):
    """Plain GPT-2, batch-first, from a {name: full tensor} dict; per-token loss [b, s]."""
    batch, seq = tokens.shape
    hidden_size, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden_size // heads
    masks = CounterBasedDropout(stable_seed(SEED, "dropout"))

    def drop(x, probability, layer, site, full_shape):
        if not dropout_on or probability == 0:
            return x
        keep = masks.keep_mask(probability, layer, site, sample_ids, full_shape)
        return x * keep.to(x.dtype) / (1 - probability)

    def norm(x, prefix):
        return F.layer_norm(x, (hidden_size,), params[prefix + ".weight"],
                            params[prefix + ".bias"], config.layernorm_epsilon)

    x = params["embedding.word_embeddings.weight"][tokens] + \
        params["embedding.position_embeddings.weight"][:seq]
    x = drop(x, config.hidden_dropout, 0, SITE_EMBEDDING, (seq, hidden_size))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for index in range(config.num_layers):
        p = f"decoder.layers.{index}."
        qkv = norm(x, p + "input_layernorm") @ params[p + "self_attention.linear_qkv.weight"].T \
            + params[p + "self_attention.linear_qkv.bias"]
        qkv = qkv.view(batch, seq, heads, 3, head_dim)
        q, k, v = (qkv[:, :, :, j, :].transpose(1, 2) for j in range(3))  # [b, heads, s, hd]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        probs = drop(probs, config.attention_dropout, index + 1, SITE_ATTENTION_PROBS,
                     (heads, seq, seq))
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, hidden_size)
        attention = context @ params[p + "self_attention.linear_proj.weight"].T \
            + params[p + "self_attention.linear_proj.bias"]
        x = x + drop(attention, config.hidden_dropout, index + 1, SITE_ATTENTION_OUTPUT,
                     (seq, hidden_size))
        hidden = F.gelu(norm(x, p + "pre_mlp_layernorm") @ params[p + "mlp.linear_fc1.weight"].T
                        + params[p + "mlp.linear_fc1.bias"])
        mlp = hidden @ params[p + "mlp.linear_fc2.weight"].T + params[p + "mlp.linear_fc2.bias"]
        x = x + drop(mlp, config.hidden_dropout, index + 1, SITE_MLP_OUTPUT, (seq, hidden_size))
    x = norm(x, "decoder.final_layernorm")
    output = params.get("output_layer.weight", params["embedding.word_embeddings.weight"])
    logits = x @ output.T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="none").view(batch, seq)


def loss_and_grads(model, tokens, labels, sample_ids=None):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels, sample_ids=sample_ids)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout_on", [False, True])
@pytest.mark.parametrize("untied", [False, True])
def test_model_matches_reference_gpt2(dropout_on, untied):
    config = make_config(untie_embeddings_and_output_weights=untied)
    model = build(config)
    model.train(dropout_on)
    tokens, labels = make_batch()
    sample_ids = torch.tensor([7, 0, 123456789012])
    loss, grads = loss_and_grads(model, tokens, labels, sample_ids)

    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    expected = reference_loss(params, config, tokens, labels, sample_ids, dropout_on)
    expected.sum().backward()
    assert loss.dtype == torch.float64 and loss.shape == tokens.shape
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    assert set(grads) == set(params)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, params[name].grad, rtol=1e-10, atol=1e-12, msg=name)
    if dropout_on:  # the masks really act: the dropout-free loss differs
        no_dropout = reference_loss(params, config, tokens, labels, sample_ids, False)
        assert (no_dropout - expected).abs().max() > 1e-3


def test_logits_and_eval_mode():
    model = build(make_config())
    tokens, labels = make_batch()
    model.eval()
    logits = model(tokens)
    assert logits.shape == (3, 12, VOCAB)
    loss = model(tokens, labels)
    torch.testing.assert_close(
        loss, F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                              reduction="none").view(3, 12))
    model.train()  # dropout on: different loss, and the same again for the same sample ids
    first, second = model(tokens, labels), model(tokens, labels)
    assert not torch.allclose(first, loss)
    assert torch.equal(first, second)
    shifted = model(tokens, labels, sample_ids=torch.tensor([10, 11, 12]))
    assert not torch.allclose(first, shifted)


def run_chunks(config, boundaries, tokens, labels, sample_ids):
    """Run the model as consecutive chunks [b_i, b_{i+1}); return loss and the chunks."""
    pairs = list(zip(boundaries[:-1], boundaries[1:]))
    chunks = [build(config, layer_range=range(start, stop), pre_process=index == 0,
                    post_process=index == len(pairs) - 1)
              for index, (start, stop) in enumerate(pairs)]
    inputs, sent = tokens, []
    for chunk in chunks[:-1]:
        output = chunk(inputs, sample_ids=sample_ids)
        assert output.shape == (tokens.shape[1], tokens.shape[0], config.hidden_size)
        inputs = output.detach().requires_grad_()
        sent.append((output, inputs))
    loss = chunks[-1](inputs, labels, sample_ids=sample_ids)
    loss.sum().backward()
    for output, received in reversed(sent):  # the pipeline's backward, stage by stage
        output.backward(received.grad)
    return loss.detach(), chunks


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("boundaries", [(0, 2, 4), (0, 1, 3, 4), (0, 0, 4)])
def test_pipeline_chunks_reproduce_whole_model(untied, boundaries):
    config = make_config(untie_embeddings_and_output_weights=untied)
    tokens, labels = make_batch()
    sample_ids = torch.tensor([3, 4, 5])
    whole = build(config)
    loss, grads = loss_and_grads(whole, tokens, labels, sample_ids)
    chunk_loss, chunks = run_chunks(config, list(boundaries), tokens, labels, sample_ids)
    torch.testing.assert_close(chunk_loss, loss, rtol=1e-13, atol=1e-13)

    whole_params = dict(whole.named_parameters())
    summed = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            assert torch.equal(param, whole_params[name]), f"{name} initialised differently"
            summed[name] = summed.get(name, 0) + param.grad
    assert set(summed) == set(grads)
    for name in grads:
        torch.testing.assert_close(summed[name], grads[name], rtol=1e-12, atol=1e-13, msg=name)

    shared = [(i, n) for i, c in enumerate(chunks) for n, p in c.named_parameters()
              if p.shared_embedding]
    if untied:
        assert shared == []
        assert "output_layer.weight" in dict(chunks[-1].named_parameters())
    else:  # the first and the last chunk both hold the word embedding, flagged as shared
        name = "embedding.word_embeddings.weight"
        assert shared == [(0, name), (len(chunks) - 1, name)]
        # neither copy alone has the whole gradient: the runtime must sum them
        assert not torch.allclose(dict(chunks[0].named_parameters())[name].grad, grads[name])


@pytest.mark.parametrize("recompute", [
    RecomputeConfig(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1),
    RecomputeConfig(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=3),
    RecomputeConfig(recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=2),
    RecomputeConfig(recompute_granularity="selective"),
    RecomputeConfig(checkpoint_activations=True),
], ids=["uniform1", "uniform3", "block2", "selective", "legacy"])
def test_recomputation_changes_no_number(recompute):
    config = make_config()
    tokens, labels = make_batch()
    loss, grads = loss_and_grads(build(config), tokens, labels)
    recomputed = build(config, recompute)
    recomputed_loss, recomputed_grads = loss_and_grads(recomputed, tokens, labels)
    assert torch.equal(recomputed_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(recomputed_grads[name], grad), name


def test_recomputation_stores_fewer_activations():
    config = make_config(num_layers=4)
    tokens, labels = make_batch()

    def saved_bytes(model):
        total = []

        def pack(tensor):
            total.append(tensor.numel() * tensor.element_size())
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, labels)
        loss.sum().backward()
        return sum(total)

    plain = saved_bytes(build(config))
    full = saved_bytes(build(config, RecomputeConfig(recompute_granularity="full",
                                                      recompute_method="uniform",
                                                      recompute_num_layers=1)))
    assert full < plain / 2


def test_initialisation_is_layout_independent_and_follows_gpt2():
    config = make_config(untie_embeddings_and_output_weights=True)
    full = dict(build(config).named_parameters())
    tp_size = 2
    shards = [dict(GPTModel(config, None, ParallelState(RankLayout(tp_size, 1, 1), rank), SEED,
                            params_dtype=torch.float64).named_parameters())
              for rank in range(tp_size)]
    for name, param in full.items():
        if param.tensor_model_parallel:
            rebuilt = torch.cat([s[name] for s in shards], dim=param.partition_dim)
        else:
            assert torch.equal(shards[0][name], shards[1][name]), name
            rebuilt = shards[0][name]
        assert torch.equal(rebuilt, param), name

    # float32 parameters are the float64 ones rounded: the draws do not depend on the dtype
    single = dict(GPTModel(config, None, ParallelState.single_process(), SEED).named_parameters())
    for name, param in full.items():
        assert torch.equal(single[name], param.to(torch.float32)), name

    std = config.init_method_std
    scaled = std / math.sqrt(2 * config.num_layers)
    big = full["embedding.word_embeddings.weight"]
    assert abs(big.std().item() - std) < 0.1 * std
    for name, param in full.items():
        if name.endswith("bias"):
            assert torch.all(param == 0), name
        elif "layernorm" in name:
            assert torch.all(param == 1), name
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert abs(param.std().item() - scaled) < 0.15 * scaled, name
        else:
            assert abs(param.std().item() - std) < 0.15 * std, name
    # different parameters get different draws, a different seed gives different weights
    assert not torch.allclose(full["decoder.layers.0.mlp.linear_fc1.weight"],
                              full["decoder.layers.1.mlp.linear_fc1.weight"])
    other = GPTModel(config, None, ParallelState.single_process(), SEED + 1,
                     params_dtype=torch.float64)
    assert not torch.allclose(dict(other.named_parameters())["output_layer.weight"],
                              full["output_layer.weight"])


def test_parameter_attributes():
    model = build(make_config())
    for name, param in model.named_parameters():
        is_bias_or_norm = name.endswith("bias") or "layernorm" in name
        assert param.no_weight_decay == is_bias_or_norm, name
        assert isinstance(param.tensor_model_parallel, bool) and param.shared_embedding is False
        assert (param.partition_dim >= 0) == param.tensor_model_parallel, name
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides, tp_size, message", [
    (dict(num_attention_heads=3), 1, "num-attention-heads"),
    (dict(num_attention_heads=2, hidden_size=32), 4, "tensor-model-parallel-size"),
    (dict(padded_vocab_size=None), 1, "padded_vocab_size"),
    (dict(padded_vocab_size=97), 2, "padded vocabulary"),
    (dict(seq_length=32), 1, "max-position-embeddings"),
    (dict(swiglu=True, squared_relu=True), 1, "squared-relu"),
    (dict(group_query_attention=True), 1, "needs --num-query-groups"),
    (dict(group_query_attention=True, num_query_groups=3), 1, "multiple of num-query-groups"),
    (dict(group_query_attention=True, num_query_groups=2), 4, "num-query-groups"),
    (dict(position_embedding_type="rope", rotary_percent=0.1), 1, "rotary-percent"),
])
def test_bad_configurations_explain_themselves(overrides, tp_size, message):
    with pytest.raises(ValueError, match=message):
        GPTModel(make_config(**overrides), None,
                 ParallelState(RankLayout(tp_size, 1, 1), 0), SEED)
