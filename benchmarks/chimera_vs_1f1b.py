"""Chimera vs 1F1B vs GPipe: the paper's relative claims, measured on CPU/gloo and predicted by the simulator.

One command: ``python benchmarks/chimera_vs_1f1b.py [--quick] [--pipeline-model-parallel-size D]``.

1. Measured (D=4 by default, D forked gloo ranks, the tiny GPT of :mod:`_harness`; D=2 gives one rank
   per core on a 2-core machine): iteration time of 1F1B,
   GPipe, Chimera direct and Chimera forward doubling at the same model, global batch and N
   (N = D and 2D; all schedules and N run side by side in one process group, iterations interleaved,
   median of the timed iterations), the measured speedup over 1F1B next to the simulator's
   prediction with the measured Bk/F and with Bk = 2F, the simulator's bubble ratio, and the
   measured peak stored activations per rank (memory balance).
2. Simulator only (no processes): D = 8, 16, 32 at N = D and N = 2D with Bk = 2F: bubble ratios and
   predicted Chimera/1F1B speedups, next to the paper's 1.21x at D = N = 32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _harness import (MODEL_FLAGS, format_table, oversubscription_note,  # noqa: E402
                      run_side_by_side, summarize)

#: (label, schedule flags, simulator (name, options)).
SCHEDULES = (
    ("1f1b", ["--pipeline-schedule", "1f1b"], ("1f1b", {})),
    ("gpipe", ["--pipeline-schedule", "gpipe"], ("gpipe", {})),
    ("chimera direct", ["--pipeline-schedule", "chimera", "--chimera-variant", "direct"],
     ("chimera", {"variant": "direct"})),
    ("chimera fwd-doubling", ["--pipeline-schedule", "chimera", "--chimera-variant",
                              "forward-doubling"], ("chimera", {"variant": "forward-doubling"})),
)

PAPER_SPEEDUP_D32_N32 = 1.21


def simulate(name: str, depth: int, num_microbatches: int, backward_ratio: float, options: dict):
    """Simulator result of one schedule with F = 1 and Bk = ``backward_ratio`` (zero p2p cost)."""
    from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule

    _, _, result = simulate_schedule(name, depth, num_microbatches, forward_cost=1.0,
                                     backward_cost=backward_ratio, **options)
    return result


def allowed(name: str, options: dict, depth: int, num_microbatches: int) -> bool:
    """Whether the schedule is defined for (D, N) (forward doubling needs N a multiple of D)."""
    from megatron.core.pipeline_parallel.planning.schedules.chimera import check_chimera

    if name != "chimera":
        return True
    try:
        check_chimera(depth, num_microbatches, 2, options.get("variant", "direct"))
    except ValueError:
        return False
    return True


def measure_backward_ratio(repeats: int) -> tuple:
    """Measured (F, Bk) in seconds of the whole tiny model on one micro-batch, one process, one thread.

    Only the ratio Bk/F enters the prediction (with zero p2p cost the makespan scales with F).
    """
    import torch

    import pretrain_gpt
    from megatron.core.parallel_state import ParallelState
    from megatron.training.arguments import parse_args
    from megatron.training.microbatches import build_microbatches

    torch.set_num_threads(1)
    config = parse_args(MODEL_FLAGS + ["--global-batch-size", "2"], world_size=1)
    model = pretrain_gpt.model_provider(config, ParallelState.single_process())
    parallel_state = ParallelState.single_process()
    dataset, _, _ = pretrain_gpt.datasets_provider(config, parallel_state, (2, 0, 0))
    batch = build_microbatches(dataset, 0, 2, 1, 0, 1, torch.device("cpu"))[0]
    forwards, backwards = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        output, loss_fn = pretrain_gpt.forward_step(batch, model)
        loss, _ = loss_fn(output)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        forwards.append(middle - start)
        backwards.append(end - middle)
    return statistics.median(forwards[1:]), statistics.median(backwards[1:])


def measured_variants(depth: int, microbatch_counts: list) -> list:
    """(label, N, simulator spec, flags) of every schedule allowed at (D, N)."""
    variants = []
    for num_microbatches in microbatch_counts:
        for label, flags, (name, options) in SCHEDULES:
            if not allowed(name, options, depth, num_microbatches):
                continue
            variants.append((label, num_microbatches, (name, options),
                             ["--pipeline-model-parallel-size", str(depth),
                              "--global-batch-size", str(2 * num_microbatches)] + flags))
    return variants


def run_measured(depth: int, microbatch_counts: list, warmup: int, iterations: int,
                 backward_ratio: float) -> list:
    """Measure every allowed schedule side by side; rows with measured and predicted numbers."""
    variants = measured_variants(depth, microbatch_counts)
    per_rank = run_side_by_side(depth, [flags for *_, flags in variants], warmup=warmup,
                                iterations=iterations, timeout=600)
    rows = []
    for index, (label, num_microbatches, (name, options), _) in enumerate(variants):
        summary = summarize(per_rank, index, iterations)
        measured_sim = simulate(name, depth, num_microbatches, backward_ratio, options)
        bk2_sim = simulate(name, depth, num_microbatches, 2.0, options)
        rows.append({"schedule": label, "N": num_microbatches, **summary,
                     "makespan_measured_bk": measured_sim.makespan,
                     "makespan_bk2": bk2_sim.makespan, "bubble_bk2": bk2_sim.bubble_ratio,
                     "bubble_measured_bk": measured_sim.bubble_ratio,
                     "simulated_peaks": list(measured_sim.peak_activations)})
    for row in rows:
        base = next(r for r in rows if r["N"] == row["N"] and r["schedule"] == "1f1b")
        row["speedup"] = base["seconds"] / row["seconds"]
        row["predicted_measured_bk"] = base["makespan_measured_bk"] / row["makespan_measured_bk"]
        row["predicted_bk2"] = base["makespan_bk2"] / row["makespan_bk2"]
    return rows


def print_measured(rows: list, backward_ratio: float) -> None:
    table = [[row["schedule"], row["N"], f"{row['seconds'] * 1e3:.0f}", f"{row['speedup']:.2f}",
              f"{row['predicted_measured_bk']:.2f}", f"{row['predicted_bk2']:.2f}",
              f"{row['bubble_measured_bk']:.3f}", f"{row['p2p_seconds'] * 1e3:.0f}",
              " ".join(map(str, row["peaks"])), " ".join(map(str, row["simulated_peaks"])),
              " ".join(f"{b / 1e6:.1f}" for b in row["peak_bytes"])]
             for row in rows]
    print(format_table(["schedule", "N", "iter ms (median)", "speedup vs 1f1b",
                        f"predicted (Bk={backward_ratio:.2f}F)", "predicted (Bk=2F)",
                        "sim bubble", "p2p ms/rank", "peak stored/rank", "sim peak/rank",
                        "peak MB/rank"], table))


def simulator_table(depths: list) -> list:
    """Bubble ratios and predicted Chimera/1F1B speedups with Bk = 2F, zero p2p cost."""
    rows = []
    for depth in depths:
        for num_microbatches in (depth, 2 * depth):
            results = {label: simulate(name, depth, num_microbatches, 2.0, options)
                       for label, _, (name, options) in SCHEDULES
                       if allowed(name, options, depth, num_microbatches)}
            base = results["1f1b"]
            rows.append({"D": depth, "N": num_microbatches,
                         "bubbles": {k: v.bubble_ratio for k, v in results.items()},
                         "speedups": {k: base.makespan / v.makespan for k, v in results.items()},
                         "peaks": {k: (min(v.peak_activations), max(v.peak_activations))
                                   for k, v in results.items()}})
    return rows


def print_simulator(rows: list) -> None:
    labels = [label for label, *_ in SCHEDULES]
    table = []
    for row in rows:
        cells = [f"D={row['D']} N={row['N']}"]
        cells += [f"{row['bubbles'][k]:.3f}" if k in row["bubbles"] else "-" for k in labels]
        cells += [f"{row['speedups'][k]:.3f}" if k in row["speedups"] else "-" for k in labels[1:]]
        cells += [f"{row['peaks'][k][0]}-{row['peaks'][k][1]}" if k in row["peaks"] else "-"
                  for k in ("1f1b", "chimera direct")]
        table.append(cells)
    print(format_table(["case"] + [f"bubble {k}" for k in labels]
                       + [f"{k}/1f1b" for k in labels[1:]]
                       + ["peak 1f1b", "peak chimera"], table))
    paper = next((r for r in rows if r["D"] == 32 and r["N"] == 32), None)
    if paper is not None:
        print(f"Paper (chimera.md section 8): Chimera over 1F1B {PAPER_SPEEDUP_D32_N32:.2f}x at "
              f"D = N = 32, Bk = 2F; simulator: {paper['speedups']['chimera direct']:.3f}x.")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="N=4 only, 1 warm-up + 3 timed iterations, simulator D=8,16 (about a minute)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 2)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 7)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=4, dest="depth",
                        help="D of the measured runs, one gloo rank per stage (default 4; 2 gives "
                             "one rank per core on a 2-core machine)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="N values to measure (default D and 2D; quick D)")
    parser.add_argument("--simulator-depths", type=int, nargs="+", default=None,
                        help="D values of the simulator-only table (default 8 16 32; quick 8 16)")
    parser.add_argument("--skip-measured", action="store_true",
                        help="only the simulator-only table (no processes)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.iters = args.iters if args.iters is not None else (3 if args.quick else 7)
    if args.depth < 2 or args.depth % 2:
        raise ValueError(f"--pipeline-model-parallel-size needs an even D >= 2 for Chimera "
                         f"(got {args.depth})")
    args.microbatches = args.microbatches or (
        [args.depth] if args.quick else [args.depth, 2 * args.depth])
    args.simulator_depths = args.simulator_depths or ([8, 16] if args.quick else [8, 16, 32])
    for depth in args.simulator_depths:
        if depth < 2 or depth % 2:
            raise ValueError(f"--simulator-depths needs even depths >= 2 for Chimera (got {depth})")
    return args


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    depth = args.depth
    measured = []
    if not args.skip_measured:
        forward, backward = measure_backward_ratio(repeats=3 if args.quick else 7)
        ratio = backward / forward
        print(f"== Measured, D={depth} on {depth} gloo ranks (tiny GPT: hidden 64, 8 layers, seq 64, "
              f"micro-batch 2, float32), median of {args.iters} iterations after {args.warmup} "
              "warm-up ==")
        print(oversubscription_note(depth))
        print(f"Measured one process, whole model, one micro-batch: F = {forward * 1e3:.1f} ms, "
              f"Bk = {backward * 1e3:.1f} ms (Bk/F = {ratio:.2f}).")
        measured = run_measured(depth, args.microbatches, args.warmup, args.iters, ratio)
        print_measured(measured, ratio)
        print("speedup = 1f1b iter time / this iter time (same N, same global batch). predicted = "
              "simulated 1f1b makespan / this makespan, zero p2p cost. peak stored = activations "
              "held at once by the rank's interpreter (measured); sim peak = simulator's count.")
    print("\n== Simulator only (Bk = 2F, zero p2p cost, no processes) ==")
    simulated = simulator_table(args.simulator_depths)
    print_simulator(simulated)
    return {"measured": measured, "simulated": simulated}


if __name__ == "__main__":
    main()
