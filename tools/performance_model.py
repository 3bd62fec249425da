#!/usr/bin/env python
"""Predict iteration time, throughput and memory of pipeline configurations (Chimera §3.4).

Enumerates (W, D) with W·D = --world-size, a micro-batch size and recomputation per shape, and
prints the configurations ranked by predicted sequences/s. With --pipeline-model-parallel-size
(and --micro-batch-size) it evaluates that one shape only, e.g. to compare schemes at the same
(W, D, B). No torch needed. Model: the megatron/performance_model/ package;
documentation: docs/performance_model.md.

Example (the paper's GPT-2 on 512 P100 nodes):

    python tools/performance_model.py --num-layers 64 --hidden-size 1280 \
        --num-attention-heads 20 --seq-length 632 --max-position-embeddings 1024 \
        --vocab-size 50257 --world-size 512 --global-batch-size 512
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from megatron.performance_model import (  # noqa: E402
    ANALYTIC_SCHEMES, P100_ARIES, SCHEMES, HardwareSpec, ModelSpec, launch_flags, search_configurations)

GRAD_SYNC_POLICIES = ("eager-opt", "eager", "end")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--seq-length", type=int, required=True)
    model.add_argument("--vocab-size", type=int, required=True)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    model.add_argument("--max-position-embeddings", type=int, default=None,
                       help="position-embedding rows (parameter count only); default seq length")
    model.add_argument("--bytes-per-value", type=int, default=4,
                       help="4 = fp32 as in the paper, 2 = fp16/bf16 values")
    run = parser.add_argument_group("run")
    run.add_argument("--world-size", type=int, required=True,
                     help="P workers (per tensor-parallel slice) = W x D")
    run.add_argument("--global-batch-size", type=int, required=True)
    run.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                     help="evaluate only this D (W = world size / D)")
    run.add_argument("--micro-batch-size", type=int, default=None,
                     help="fix B; default: search the divisors of mini-batch / W")
    run.add_argument("--recompute", choices=("auto", "none", "selective", "full", "on", "off"),
                     default="auto", help="recomputation granularity; auto tries none, "
                     "selective and full (on = full, off = none)")
    run.add_argument("--distributed-optimizer", action="store_true",
                     help="shard optimizer state over the stage's replicas (memory only)")
    run.add_argument("--micro-batch-policy", choices=("fastest", "largest"), default="fastest",
                     help="per shape keep the fastest fitting B, or the largest (paper's rule)")
    run.add_argument("--schemes", default="chimera-direct",
                     help=f"comma-separated subset of {','.join(SCHEMES)}, or 'all'")
    run.add_argument("--grad-sync", choices=GRAD_SYNC_POLICIES, default="eager-opt")
    run.add_argument("--stage-balance", choices=("balanced", "slowest"), default="balanced",
                     help="F = model FLOPs / D (paper) or the slowest stage of an even split")
    hardware = parser.add_argument_group(
        "hardware (defaults: the P100 + Cray Aries profile, fp32; fitted constants, see docs)")
    hardware.add_argument("--flops-per-second", type=float, default=9.3e12,
                          help="peak FLOP/s of one worker (P100 fp32: 9.3e12)")
    hardware.add_argument("--flops-efficiency", type=float,
                          default=P100_ARIES.flops_per_second / 9.3e12,
                          help="sustained fraction of the peak on large micro-batches")
    hardware.add_argument("--half-efficiency-tokens", type=float,
                          default=P100_ARIES.half_efficiency_tokens,
                          help="micro-batch tokens (B x s) at which half that rate is reached")
    hardware.add_argument("--op-overhead", type=float, default=P100_ARIES.op_overhead_seconds,
                          help="fixed seconds per forward or backward op of a stage")
    hardware.add_argument("--alpha", type=float, default=P100_ARIES.alpha,
                          help="message latency, seconds")
    hardware.add_argument("--beta", type=float, default=P100_ARIES.beta,
                          help="seconds per byte of a worker's link (2e-10 = 5 GB/s)")
    hardware.add_argument("--device-memory-gb", type=float, default=16.0)
    hardware.add_argument("--framework-overhead-gb", type=float,
                          default=P100_ARIES.framework_overhead_bytes / 1e9,
                          help="memory besides model state and activations")
    hardware.add_argument("--state-bytes-per-parameter", type=int, default=16,
                          help="weights + gradients + optimizer state (fp32 Adam: 16)")
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    return parser.parse_args(argv)


def _schemes(text: str) -> tuple:
    names = tuple(SCHEMES) if text == "all" else tuple(n.strip() for n in text.split(",") if n)
    unknown = [name for name in names if name not in SCHEMES]
    if unknown or not names:
        raise ValueError(f"unknown scheme(s) {', '.join(unknown) or '(none)'} in --schemes; "
                         f"use a comma-separated subset of {', '.join(SCHEMES)} or 'all'")
    return names


def run(args) -> list:
    model = ModelSpec(args.num_layers, args.hidden_size, args.num_attention_heads,
                      args.seq_length, args.vocab_size, args.ffn_hidden_size,
                      args.max_position_embeddings, args.bytes_per_value)
    hardware = HardwareSpec(args.flops_per_second * args.flops_efficiency, args.alpha, args.beta,
                            args.device_memory_gb * 1e9, args.state_bytes_per_parameter,
                            half_efficiency_tokens=args.half_efficiency_tokens,
                            framework_overhead_bytes=args.framework_overhead_gb * 1e9,
                            op_overhead_seconds=args.op_overhead)
    shapes = None
    if args.pipeline_model_parallel_size:
        depth = args.pipeline_model_parallel_size
        if args.world_size % depth:
            raise ValueError(f"--pipeline-model-parallel-size {depth} must divide --world-size "
                             f"{args.world_size}")
        shapes = [(args.world_size // depth, depth)]
    recompute = {"auto": None, "on": "full", "off": "none"}.get(args.recompute, args.recompute)
    return search_configurations(model, hardware, args.world_size, args.global_batch_size,
                                 _schemes(args.schemes), args.micro_batch_size, recompute,
                                 args.grad_sync, args.stage_balance, args.micro_batch_policy,
                                 shapes, recompute_modes=("none", "selective", "full"),
                                 distributed_optimizer=args.distributed_optimizer)


def format_table(estimates, top: int) -> str:
    header = (f"{'scheme':<25}{'W':>5}{'D':>4}{'B':>4}{'N':>5} {'recomp':<7}"
              f"{'T_model(s)':>11}{'T_sim(s)':>10}{'seq/s':>9}{'mem/GB':>8} fits")
    lines = [header, "-" * len(header)]
    for estimate in estimates[:top]:
        closed = ("-" if estimate.closed_form_time is None
                  else f"{estimate.closed_form_time:.4f}")
        lines.append(
            f"{estimate.scheme:<25}{estimate.data_parallel:>5}{estimate.pipeline:>4}"
            f"{estimate.micro_batch_size:>4}{estimate.num_microbatches:>5} "
            f"{estimate.recompute:<7}{closed:>11}"
            f"{estimate.simulated_time:>10.4f}{estimate.throughput:>9.1f}"
            f"{estimate.max_memory / 1e9:>8.2f} {'yes' if estimate.fits else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        estimates = run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not estimates:
        print("no valid configuration: check that some D divides --num-layers and "
              "--world-size, and W = P/D divides --global-batch-size", file=sys.stderr)
        return 1
    print(format_table(estimates, args.top))
    print("T_model: closed form of paper §3.4 ('-' where no closed form); T_sim: lowered "
          "schedule simulated, or the analytic baseline (ranking); mem: the largest worker")
    runnable = (e for e in estimates if e.fits and e.scheme not in ANALYTIC_SCHEMES)
    best = next(runnable, None)
    if best is not None:
        print(f"pretrain_gpt.py flags of the best fitting runnable configuration: "
              f"{launch_flags(best, args.grad_sync)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
