"""Generation with a KV cache: cached logits equal the full forward pass, greedy decoding equals a
step-by-step recomputation without cache, sampling is reproducible and respects top-k / top-p,
and tools/generate.py runs on a pipeline checkpoint."""

import pytest
import torch

from megatron.inference.generation import (
    KVCache, SamplingParams, forward_with_cache, full_logits, generate, next_token)
from megatron.inference.loading import load_model
from inference_helpers import LLAMA, VOCAB, random_full_weights, tiny_config, write_checkpoint

torch.set_num_threads(1)
PROMPT = [3, 17, 42, 5, 9]


@pytest.fixture(scope="module")
def pipeline_checkpoint(tmp_path_factory):
    config = tiny_config(1, 2, "chimera")
    root = tmp_path_factory.mktemp("gen") / "ckpt"
    return write_checkpoint(root, config, random_full_weights(config, scale=0.3))


def test_cached_logits_equal_the_full_forward_pass(pipeline_checkpoint):
    model, _ = load_model(pipeline_checkpoint)
    tokens = torch.tensor([PROMPT + [11, 12, 13]])
    cache = KVCache()
    pieces = [forward_with_cache(model, tokens[:, :5], cache)]
    pieces += [forward_with_cache(model, tokens[:, i:i + 1], cache) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_logits(model, tokens),
                               atol=1e-5, rtol=0)


def test_greedy_generation_equals_recomputation_without_cache(pipeline_checkpoint):
    model, _ = load_model(pipeline_checkpoint)
    generated = generate(model, PROMPT, 10, SamplingParams(), vocab_size=VOCAB)
    sequence = list(PROMPT)
    for _ in range(10):  # no cache: run the whole sequence each step
        logits = full_logits(model, torch.tensor([sequence]))[0, -1, :VOCAB]
        sequence.append(int(logits.argmax()))
    assert generated == sequence[len(PROMPT):]
    assert len(set(generated)) > 1  # not a degenerate constant output
    # the sequence limit (16 positions) stops generation
    assert len(generate(model, PROMPT, 100, SamplingParams(), vocab_size=VOCAB)) == 16 - 5


@pytest.mark.parametrize("layout", [(1, 1, None), (1, 2, "chimera")], ids=["pp1", "chimera-pp2"])
def test_llama_style_cached_generation_equals_the_full_forward_pass(tmp_path, layout):
    """RoPE rotates cached keys by their position and grouped-query attention caches one key/value
    per group: the cached logits and greedy generation match the uncached forward pass."""
    config = tiny_config(*layout, extra=LLAMA)
    model, _ = load_model(write_checkpoint(tmp_path / "ckpt", config,
                                           random_full_weights(config, scale=0.3)))
    tokens = torch.tensor([PROMPT + [11, 12, 13]])
    cache = KVCache()
    pieces = [forward_with_cache(model, tokens[:, :5], cache)]
    pieces += [forward_with_cache(model, tokens[:, i:i + 1], cache) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_logits(model, tokens),
                               atol=1e-5, rtol=0)
    generated = generate(model, PROMPT, 6, SamplingParams(), vocab_size=VOCAB)
    sequence = list(PROMPT)
    for _ in range(6):
        sequence.append(int(full_logits(model, torch.tensor([sequence]))[0, -1, :VOCAB].argmax()))
    assert generated == sequence[len(PROMPT):]


def test_sampling_is_reproducible_and_filtered():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 9.0, 8.0]])  # id 4, 5 best; ids >= 5 are padding
    top2 = SamplingParams(greedy=False, temperature=4.0, top_k=2)
    draws = {int(next_token(logits, top2, 5, generator)) for _ in range(200)}
    assert draws == {1, 4}  # the two best non-padding ids
    nucleus = SamplingParams(greedy=False, top_p=0.5)
    assert {int(next_token(logits, nucleus, 5, generator)) for _ in range(20)} == {4}
    assert int(next_token(logits, SamplingParams(), 5, None)) == 4
    hot = SamplingParams(greedy=False, temperature=100.0)
    assert len({int(next_token(logits, hot, 5, generator)) for _ in range(200)}) == 5
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_sampled_generation_repeats_with_the_same_seed(pipeline_checkpoint):
    model, _ = load_model(pipeline_checkpoint)
    params = SamplingParams(greedy=False, temperature=1.5, top_k=20, top_p=0.9, seed=4)
    first = generate(model, PROMPT, 8, params, vocab_size=VOCAB)
    assert first == generate(model, PROMPT, 8, params, vocab_size=VOCAB)
    assert all(0 <= token < VOCAB for token in first)


def test_generate_tool_prints_the_greedy_continuation(pipeline_checkpoint, capsys):
    from tools.generate import main
    model, _ = load_model(pipeline_checkpoint)
    expected = generate(model, PROMPT, 4, SamplingParams(), vocab_size=None)
    assert main(["--load", pipeline_checkpoint, "--prompt-ids", " ".join(map(str, PROMPT)),
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in PROMPT + expected]
    assert main(["--load", pipeline_checkpoint, "--prompt", "hello", "--device", "cpu"]) == 1
