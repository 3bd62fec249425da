"""Generation on 2 tensor-parallel ranks (gloo) produces the same tokens as one process, greedy
and sampled, from a TP2 checkpoint loaded at TP 2 and at TP 1."""

import torch

from dist_harness import run_distributed
from megatron.core.parallel_state import RankLayout, create_parallel_state
from megatron.inference.generation import SamplingParams, forward_with_cache, generate, KVCache
from megatron.inference.loading import load_model
from inference_helpers import VOCAB, random_full_weights, tiny_config, write_checkpoint

PROMPT = [3, 17, 42, 5, 9]
SAMPLED = SamplingParams(greedy=False, temperature=1.2, top_k=30, top_p=0.95, seed=11)


def _generate_all(model):
    tokens = torch.tensor([PROMPT])
    return (generate(model, PROMPT, 8, SamplingParams(), vocab_size=VOCAB),
            generate(model, PROMPT, 8, SAMPLED, vocab_size=VOCAB),
            forward_with_cache(model, tokens, KVCache()))


def _tensor_parallel_rank(rank, world_size, root):
    state = create_parallel_state(RankLayout(world_size, 1, 1), rank, "gloo")
    model, _ = load_model(root, state)
    assert model.embedding.word_embeddings.weight.shape[0] == 64 // world_size
    return _generate_all(model)


def test_tensor_parallel_generation_matches_one_process(tmp_path):
    config = tiny_config(2, 1)
    root = write_checkpoint(tmp_path / "ckpt", config, random_full_weights(config, scale=0.3))
    greedy, sampled, logits = _generate_all(load_model(root)[0])
    results = run_distributed(_tensor_parallel_rank, 2, root, timeout=60)
    for rank_greedy, rank_sampled, rank_logits in results:
        assert rank_greedy == greedy
        assert rank_sampled == sampled
        torch.testing.assert_close(rank_logits, logits, atol=1e-5, rtol=0)
    assert greedy != sampled
