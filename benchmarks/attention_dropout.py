#!/usr/bin/env python
"""Attention dropout: fused (the default) vs layout-invariant masks, single process, tokens/s.

    python benchmarks/attention_dropout.py            # the issue's model, N = 4, 3 rounds
    python benchmarks/attention_dropout.py --quick    # tiny model (seconds)

Our training step (``pretrain_gpt``'s model, one process, one thread, N = 4 micro-batches) with
``--attention-dropout 0`` (fused attention, no dropout), ``--attention-dropout 0.1`` (the default:
fused ``scaled_dot_product_attention`` with dropout from a per-TP-rank stream) and
``--attention-dropout 0.1 --layout-invariant-attention-dropout`` (explicit s x s softmax with
counter-based masks). Hidden dropout is 0 in all three, so only the attention core differs.
Configurations run interleaved in rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import build_variant, format_table  # noqa: E402
from vs_torch_pipelining import model_flags  # noqa: E402

VARIANTS = (
    ("no attention dropout (fused)", ["--attention-dropout", "0"]),
    ("dropout 0.1, fused (default)", ["--attention-dropout", "0.1"]),
    ("dropout 0.1, layout-invariant", ["--attention-dropout", "0.1",
                                       "--layout-invariant-attention-dropout"]),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args(argv)
    import pretrain_gpt
    from megatron.core.parallel_state import ParallelState
    from megatron.training.training import train_step
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 3)
    base = model_flags(args.quick)
    runs = []
    for _, flags in VARIANTS:
        argv_run = base + ["--global-batch-size", "16"] + flags
        components, microbatches = build_variant(1, argv_run, ParallelState.single_process())
        train_step(components, pretrain_gpt.forward_step, microbatches)  # warm-up
        runs.append((components, microbatches))
    seconds = [[] for _ in VARIANTS]
    for _ in range(rounds):
        for index, (components, microbatches) in enumerate(runs):
            for _ in range(args.iterations):
                start = time.perf_counter()
                train_step(components, pretrain_gpt.forward_step, microbatches)
                seconds[index].append(time.perf_counter() - start)
    tokens = 16 * components.config.model.seq_length
    rows = []
    for (label, _), times in zip(VARIANTS, seconds):
        rates = [tokens / s for s in times]
        rows.append([label, f"{statistics.median(rates):.0f}",
                     f"{min(rates):.0f}-{max(rates):.0f}"])
    print(format_table(["attention", "tokens/s", "spread"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
