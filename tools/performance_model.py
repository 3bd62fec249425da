#!/usr/bin/env python
"""Predict iteration time, throughput and memory of pipeline configurations (Chimera §3.4).

Enumerates (W, D) with W·D = --world-size, a micro-batch size and recomputation per shape, and
prints the configurations ranked by predicted sequences/s. With --pipeline-model-parallel-size
(and --micro-batch-size) it evaluates that one shape only, e.g. to compare schemes at the same
(W, D, B). No torch needed, except for --measure, which calibrates the hardware constants on
this device and writes a JSON profile (--out) that --profile reads back. Model: the
megatron/performance_model/ package; documentation: docs/performance_model.md.

Example (the paper's GPT-2 on 512 P100 nodes):

    python tools/performance_model.py --num-layers 64 --hidden-size 1280 \
        --num-attention-heads 20 --seq-length 632 --max-position-embeddings 1024 \
        --vocab-size 50257 --world-size 512 --global-batch-size 512
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from megatron.performance_model import (  # noqa: E402
    ANALYTIC_SCHEMES, P100_ARIES, SCHEMES, HardwareSpec, ModelSpec, launch_flags, load_profile,
    save_profile, search_configurations)

GRAD_SYNC_POLICIES = ("eager-opt", "eager", "end")
P100_PEAK = 9.3e12  # FLOP/s of a P100 in fp32 (the shipped profile's peak)


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
    run.add_argument("--world-size", type=int, default=None,
                     help="P workers (per tensor-parallel slice) = W x D (needed unless only "
                     "--measure is asked for)")
    run.add_argument("--global-batch-size", type=int, default=None)
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
    run.add_argument("--stage-balance", choices=("balanced", "slowest", "per-stage"),
                     default="balanced",
                     help="F = model FLOPs / D (paper), the slowest stage of an even split, "
                     "or each stage its own F and Bk (per-stage: the last runs the output layer)")
    hardware = parser.add_argument_group(
        "hardware (defaults: --profile FILE, else the P100 + Cray Aries profile, fp32; fitted "
        "constants, see docs); a flag given here overrides the profile")
    hardware.add_argument("--profile", default=None,
                          help="hardware profile JSON written by --measure (or by hand)")
    hardware.add_argument("--flops-per-second", type=float, default=None,
                          help="peak FLOP/s of one worker (P100 fp32: 9.3e12); sustained = "
                          "this x --flops-efficiency (default efficiency 1 with a profile)")
    hardware.add_argument("--flops-efficiency", type=float, default=None,
                          help="sustained fraction of the peak on large micro-batches")
    hardware.add_argument("--half-efficiency-tokens", type=float, default=None,
                          help="micro-batch tokens (B x s) at which half that rate is reached")
    hardware.add_argument("--op-overhead", type=float, default=None,
                          help="fixed seconds per forward or backward op of a stage")
    hardware.add_argument("--alpha", type=float, default=None, help="message latency, seconds")
    hardware.add_argument("--beta", type=float, default=None,
                          help="seconds per byte of a worker's link (2e-10 = 5 GB/s)")
    hardware.add_argument("--device-memory-gb", type=float, default=None)
    hardware.add_argument("--framework-overhead-gb", type=float, default=None,
                          help="memory besides model state and activations")
    hardware.add_argument("--state-bytes-per-parameter", type=int, default=None,
                          help="weights + gradients + optimizer state (fp32 Adam: 16)")
    hardware.add_argument("--nodes-per-group", type=int, default=None,
                          help="dragonfly group size in nodes (0 = flat network, no contention)")
    hardware.add_argument("--global-bandwidth-fraction", type=float, default=None,
                          help="inter-group bandwidth per node when all sync, / injection")
    hardware.add_argument("--overlap-slowdown", type=float, default=None,
                          help="sigma: compute runs 1 + sigma slower under an in-flight sync")
    measure = parser.add_argument_group(
        "calibration (--measure: needs torch; runs this project's GPT stage on this device)")
    measure.add_argument("--measure", action="store_true",
                         help="measure one stage's forward/backward per micro-batch size and "
                         "p2p/all-reduce, fit the constants, write a profile")
    measure.add_argument("--out", default="hardware_profile.json",
                         help="where --measure writes the profile")
    measure.add_argument("--measure-device", default="auto", help="auto, cpu or cuda")
    measure.add_argument("--measure-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    measure.add_argument("--measure-layers", type=int, default=None,
                         help="layers of the measured stage (default: num layers / "
                         "--pipeline-model-parallel-size, else min(num layers, 4))")
    measure.add_argument("--measure-micro-batch-sizes", default="1,2,4")
    measure.add_argument("--measure-collectives", choices=("on", "off"), default="on",
                         help="p2p/all-reduce between 2 local processes (off: keep alpha/beta)")
    measure.add_argument("--measure-repeats", type=int, default=5)
    measure.add_argument("--measure-threads", type=int, default=None,
                         help="torch CPU threads while timing (default: torch's; 1 is stable "
                         "on a shared machine)")
    parser.add_argument("--top", type=int, default=20, help="rows to print")
    return parser.parse_args(argv)


def _schemes(text: str) -> tuple:
    names = tuple(SCHEMES) if text == "all" else tuple(n.strip() for n in text.split(",") if n)
    unknown = [name for name in names if name not in SCHEMES]
    if unknown or not names:
        raise ValueError(f"unknown scheme(s) {', '.join(unknown) or '(none)'} in --schemes; "
                         f"use a comma-separated subset of {', '.join(SCHEMES)} or 'all'")
    return names


def model_spec(args) -> ModelSpec:
    return ModelSpec(args.num_layers, args.hidden_size, args.num_attention_heads,
                     args.seq_length, args.vocab_size, args.ffn_hidden_size,
                     args.max_position_embeddings, args.bytes_per_value)


#: flag attribute -> (HardwareSpec field, scale from the flag's unit)
HARDWARE_FLAGS = {"half_efficiency_tokens": ("half_efficiency_tokens", 1.0),
                  "op_overhead": ("op_overhead_seconds", 1.0), "alpha": ("alpha", 1.0),
                  "beta": ("beta", 1.0), "device_memory_gb": ("device_memory_bytes", 1e9),
                  "framework_overhead_gb": ("framework_overhead_bytes", 1e9),
                  "state_bytes_per_parameter": ("state_bytes_per_parameter", 1),
                  "nodes_per_group": ("nodes_per_group", 1),
                  "global_bandwidth_fraction": ("global_bandwidth_fraction", 1.0),
                  "overlap_slowdown": ("overlap_slowdown", 1.0)}


def hardware_spec(args) -> HardwareSpec:
    """--profile (or the shipped P100_ARIES profile) with the hardware flags given applied."""
    base = load_profile(args.profile) if args.profile else P100_ARIES
    changes = {field: getattr(args, flag) * scale for flag, (field, scale)
               in HARDWARE_FLAGS.items() if getattr(args, flag) is not None}
    if args.flops_per_second is not None or args.flops_efficiency is not None:
        if args.flops_per_second is None:  # an efficiency of the profile's peak
            peak = P100_PEAK if not args.profile else base.flops_per_second
        else:
            peak = args.flops_per_second
        efficiency = args.flops_efficiency
        if efficiency is None:
            efficiency = 1.0 if args.profile else P100_ARIES.flops_per_second / P100_PEAK
        changes["flops_per_second"] = peak * efficiency
    return dataclasses.replace(base, **changes)


def run(args) -> list:
    model = model_spec(args)
    hardware = hardware_spec(args)
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


def measure(args) -> str:
    """--measure: calibrate on this device, write the profile to --out; returns a summary."""
    from megatron.training.calibration import calibrate  # torch: only here

    model = model_spec(args)
    layers = args.measure_layers or (
        args.num_layers // args.pipeline_model_parallel_size
        if args.pipeline_model_parallel_size else min(args.num_layers, 4))
    sizes = [int(size) for size in args.measure_micro_batch_sizes.split(",") if size]
    if layers < 1 or not sizes or min(sizes) < 1:
        raise ValueError("--measure-layers and --measure-micro-batch-sizes must be positive")
    base = hardware_spec(args)
    hardware, measurements, notes = calibrate(
        model, base, layers, sizes, args.measure_device, args.measure_dtype,
        args.measure_collectives == "on", args.measure_repeats, args.measure_threads)
    source = (f"tools/performance_model.py --measure on {measurements['device']} "
              f"({measurements.get('device_name', 'cpu')}), {args.measure_dtype}, stage of "
              f"{layers} layer(s) of h={args.hidden_size}, s={args.seq_length}")
    save_profile(args.out, hardware, source, measurements)
    lines = [f"wrote {args.out}: {source}",
             f"  sustained {hardware.flops_per_second / 1e12:.3f} TFLOP/s, half-efficiency "
             f"{hardware.half_efficiency_tokens:.0f} tokens, op overhead "
             f"{hardware.op_overhead_seconds * 1e3:.2f} ms, alpha {hardware.alpha * 1e6:.1f} us, "
             f"link {1 / hardware.beta / 1e9:.2f} GB/s, memory "
             f"{hardware.device_memory_bytes / 1e9:.1f} GB"]
    for record in measurements["compute"]:
        lines.append(f"  {record['layers']} layer(s), B={record['micro_batch_size']}: forward "
                     f"{record['forward_s'] * 1e3:.2f} ms, backward "
                     f"{record['backward_s'] * 1e3:.2f} ms")
    lines += [f"  note: {note}" for note in notes]
    lines.append(f"use it with: --profile {args.out}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.measure:
            print(measure(args))
            args.profile = args.out
            if args.world_size is None and args.global_batch_size is None:
                return 0
        if args.world_size is None or args.global_batch_size is None:
            raise ValueError("--world-size and --global-batch-size are needed to rank "
                             "configurations")
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
