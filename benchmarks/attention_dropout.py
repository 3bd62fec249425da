"""Attention dropout: fused (the default) vs layout-invariant masks, single process, tokens/s.

One command: ``python benchmarks/attention_dropout.py [--size issue|tiny] [--rounds R] [--iters I]``.

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
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import format_table, run_distributed  # noqa: E402
from vs_torch_pipelining import (MODEL_SIZES, OurRun, _timed_rounds, micro_batch_size,  # noqa: E402
                                 model_flags, throughput, tokens_per_iteration)

VARIANTS = (
    ("no attention dropout (fused)", ["--attention-dropout", "0"]),
    ("dropout 0.1, fused (default)", ["--attention-dropout", "0.1"]),
    ("dropout 0.1, layout-invariant", ["--attention-dropout", "0.1",
                                       "--layout-invariant-attention-dropout"]),
)


def _rank(rank: int, world_size: int, size: str, num_microbatches: int, warmup: int, rounds: int,
          iterations: int) -> list:
    import torch

    from _harness import _parallel_state

    torch.set_num_threads(1)
    batch = ["--global-batch-size", str(num_microbatches * micro_batch_size(size))]
    variants = [model_flags(size) + batch + flags for _, flags in VARIANTS]
    parallel_state = _parallel_state(rank, 1, variants)
    runs = [OurRun(rank, 1, flags, parallel_state) for flags in variants]
    return _timed_rounds(runs, warmup, rounds, iterations, lambda: None)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="issue")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    [seconds] = run_distributed(_rank, 1, args.size, args.microbatches, args.warmup, args.rounds,
                                args.iters, timeout=3000)
    tokens = tokens_per_iteration(args.size, args.microbatches)
    rows = [{"variant": label, **throughput(times, tokens)}
            for (label, _), times in zip(VARIANTS, seconds)]
    print(format_table(["attention", "tokens/s", "spread"],
                       [[r["variant"], f"{r['tokens_per_s']:.0f}", f"{r['min']:.0f}-{r['max']:.0f}"]
                        for r in rows]))
    return rows


if __name__ == "__main__":
    main()
