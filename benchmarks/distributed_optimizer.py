#!/usr/bin/env python
"""Optimizer work and memory per rank, Chimera vs 1F1B, with and without the distributed optimizer.

    python benchmarks/distributed_optimizer.py            # D = 2 and D = 4, N = 2D (a few minutes)
    python benchmarks/distributed_optimizer.py --quick    # tiny model, D = 2 (seconds)

Under Chimera every rank holds two stages, so with a replicated optimizer it steps twice the weights
of a 1F1B rank and all-reduces both stages among their replicas. ``--use-distributed-optimizer``
shards each stage over all its replicas (both directions x data parallel), so a Chimera rank steps
1/(2W) of each of its two stages. Per configuration (interleaved rounds, median over ranks' maxima):
optimizer-step time per iteration, whole-iteration time, elements stepped per rank, and optimizer +
gradient memory per rank (stepped fp32 weights' Adam state, gradient buffers, gradient shards).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.path.dirname(__file__)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _harness import build_variant, format_table, oversubscription_note, parallel_state_for  # noqa: E402,E501
from dist_harness import run_distributed  # noqa: E402

SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"], "chimera": ["--pipeline-schedule", "chimera"]}


def model_flags(quick: bool, depth: int) -> list:
    size = ("--num-layers 4 --hidden-size 32 --seq-length 16 --max-position-embeddings 16 "
            "--vocab-size 128" if quick else
            "--num-layers 8 --hidden-size 256 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1024")
    return (f"{size} --num-attention-heads 4 --make-vocab-size-divisible-by 64 "
            f"--micro-batch-size 4 --global-batch-size {4 * 2 * depth} --hidden-dropout 0 "
            f"--attention-dropout 0 --lr 1e-4 --mock-data --seed 1234 --eval-iters 0 "
            f"--train-iters 1000 --pipeline-model-parallel-size {depth}").split()


def configurations(quick: bool, depth: int) -> list:
    return [(f"{name}{' + dist-opt' if sharded else ''}",
             model_flags(quick, depth) + flags + (["--use-distributed-optimizer"] if sharded
                                                  else []))
            for name, flags in SCHEDULES.items() for sharded in (False, True)]


def optimizer_memory_bytes(components) -> int:
    """Adam state of the stepped weights, plus gradient buffers and gradient shards."""
    optimizer = components.optimizer
    state = sum(t.numel() * t.element_size() for s in optimizer.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    grads = sum(p.grad.numel() * p.grad.element_size() for chunk in components.model_chunks
                for p in chunk.parameters() if p.grad is not None)
    shards = sum(p.grad.numel() * p.grad.element_size()
                 for p in getattr(optimizer, "shards", []) if p.grad is not None)
    return state + grads + shards


def _rank(rank, world_size, configs, rounds, iterations):
    import logging

    import torch.distributed as dist
    import pretrain_gpt
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    state = parallel_state_for(rank, world_size, [flags for _, flags in configs])
    built = [(label, *build_variant(world_size, flags, state)) for label, flags in configs]
    results = {label: {"step": [], "iteration": []} for label, _, _ in built}
    for components, microbatches in [(c, m) for _, c, m in built]:  # warm-up (Adam state)
        _one_iteration(components, microbatches, pretrain_gpt.forward_step, dist.barrier)
    for _ in range(rounds):
        for label, components, microbatches in built:
            for _ in range(iterations):
                step, total = _one_iteration(components, microbatches,
                                             pretrain_gpt.forward_step, dist.barrier)
                results[label]["step"].append(step)
                results[label]["iteration"].append(total)
    for label, components, _ in built:
        results[label]["stepped"] = sum(p.numel() for p in components.optimizer.params)
        results[label]["memory"] = optimizer_memory_bytes(components)
    return results


def _one_iteration(components, microbatches, forward_step, barrier) -> tuple[float, float]:
    optimizer = components.optimizer
    barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    components.runtime.forward_backward(
        forward_step_func=forward_step, model_chunks=components.model_chunks,
        microbatches=microbatches, scale_loss=optimizer.scale_loss,
        gradient_reducers=components.gradient_reducers, forward_only=False)
    for reducer in components.gradient_reducers:
        reducer.wait()
    barrier()
    stepping = time.perf_counter()
    optimizer.step()
    step = time.perf_counter() - stepping
    barrier()
    return step, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=None)
    args = parser.parse_args(argv)
    depths = [2] if args.quick else [2, 4]
    rounds = args.rounds or (1 if args.quick else 2)
    iterations = args.iterations or (1 if args.quick else 3)
    torch.set_num_threads(1)
    for depth in depths:
        configs = configurations(args.quick, depth)
        per_rank = run_distributed(_rank, depth, configs, rounds, iterations, timeout=3600)
        rows = []
        for label, _ in configs:
            step = statistics.median(max(rank[label]["step"][i] for rank in per_rank)
                                     for i in range(rounds * iterations))
            total = statistics.median(max(rank[label]["iteration"][i] for rank in per_rank)
                                      for i in range(rounds * iterations))
            rows.append([label, f"{1000 * step:.1f}", f"{1000 * total:.0f}",
                         " ".join(str(rank[label]["stepped"]) for rank in per_rank),
                         " ".join(f"{rank[label]['memory'] / 2**20:.1f}" for rank in per_rank)])
        print(f"== D = {depth}, N = {2 * depth}, DP = 1 ==")
        print(format_table(["configuration", "optimizer step ms", "iteration ms",
                            "elements stepped per rank", "optimizer+grad MB per rank"], rows))
        print(oversubscription_note(depth))
        print()
    print(f"{rounds} interleaved round(s) x {iterations} iteration(s); medians of the slowest "
          f"rank's times.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
