#!/usr/bin/env python
"""Stored activations per rank with and without sequence parallelism (TP 2, gloo, CPU).

    python benchmarks/sequence_parallel_memory.py            # h 256, s 512, b 2, 2 layers
    python benchmarks/sequence_parallel_memory.py --quick    # tiny model (seconds)

Two gloo ranks build the same GPT (float32, hidden dropout 0.1, fused attention: attention dropout
0, so the s x s probabilities are not kept) with and without ``--sequence-parallel`` and run one
training-mode forward of one micro-batch each; :func:`count_stored_activations` adds up the
distinct storages autograd keeps for the backward pass (parameters excluded). The GPT-2 block and
the Llama-style block (RoPE, SwiGLU, RMSNorm, no biases, 2 key/value groups) are both measured.
Megatron's estimate per layer (Korthikanti et al. 2022, fp16 activations, 1-byte dropout masks,
attention scores excluded here): ``s b h (10 + 24 / t)`` without and ``s b h 34 / t`` with sequence
parallelism, a ratio of 22 / 17 = 1.29 for t = 2.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import run_distributed  # noqa: E402
from megatron.core.config import ModelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.activation_memory import count_stored_activations  # noqa: E402
from megatron.core.parallel_state import RankLayout, create_parallel_state  # noqa: E402

LLAMA = dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
             disable_bias_linear=True, group_query_attention=True, num_query_groups=2)


def model_config(quick: bool, **overrides) -> ModelConfig:
    hidden, seq = (32, 16) if quick else (256, 512)
    values = dict(num_layers=2, hidden_size=hidden, num_attention_heads=8 if not quick else 4,
                  seq_length=seq, max_position_embeddings=seq, padded_vocab_size=512,
                  attention_dropout=0.0, hidden_dropout=0.1)
    values.update(overrides)
    return ModelConfig(**values)


def stored_bytes(rank: int, world_size: int, quick: bool) -> dict:
    """{(block, sequence parallel): bytes stored by this rank's forward}."""
    torch.set_num_threads(1)
    state = create_parallel_state(RankLayout(world_size, 1, 1), rank, "gloo")
    results = {}
    for block, overrides in (("gpt2", {}), ("llama", LLAMA)):
        config = model_config(quick, **overrides)
        batch = 2
        tokens = torch.randint(0, 500, (batch, config.seq_length),
                               generator=torch.Generator().manual_seed(0))
        for sequence_parallel in (False, True):
            model = GPTModel(config, None, state, 1234, sequence_parallel=sequence_parallel)
            model.train()
            with count_stored_activations(model) as stored:
                loss = model(tokens, tokens)
            results[(block, sequence_parallel)] = stored.bytes
            loss.mean().backward()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    per_rank = run_distributed(stored_bytes, 2, args.quick, timeout=600)
    config = model_config(args.quick)
    print(f"TP 2, h {config.hidden_size}, s {config.seq_length}, b 2, {config.num_layers} layers, "
          f"float32; MiB stored per rank for one micro-batch (forward to loss)")
    print(f"{'block':<8}{'rank':>5}{'no SP':>10}{'SP':>10}{'ratio':>8}")
    for block in ("gpt2", "llama"):
        for rank, results in enumerate(per_rank):
            without, with_sp = results[(block, False)], results[(block, True)]
            print(f"{block:<8}{rank:>5}{without / 2**20:>10.2f}{with_sp / 2**20:>10.2f}"
                  f"{without / with_sp:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
