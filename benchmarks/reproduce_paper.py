"""The Chimera paper's GPT-2 figures as tables of predicted vs published (Li & Hoefler SC'21 §5).

One command: ``python benchmarks/reproduce_paper.py [--fit]``. No torch, no processes.

Tables: the 512-node (W, D) configuration sweep (and its ranking), the 2,048-node comparison of
Chimera with PipeDream-2BW, 1F1B/DAPPLE, GPipe, PipeDream and GEMS, Chimera's weak scaling
512 -> 2,048 nodes, the gradient-sync comparison (Bert-48, eager-sync vs eager-sync-opt), and the
planner's top choice at 2,048 nodes. Published numbers are read off the paper's plots
(/work/shared/reference/chimera.md §8). Every assumption is printed with the tables.

Hardware constants: ``megatron.performance_model.P100_ARIES`` (or ``--profile FILE``). Five of
them (sustained FLOP/s, per-op overhead, link bandwidth, the dragonfly's global-bandwidth
fraction γ and the overlap slowdown σ) are FITTED, by ``--fit``, on the in-sample points named
in ``IN_SAMPLE`` only (coordinate descent over ``FIT_GRID`` minimising the largest relative
error); the five 2,048-node baselines, the sync policy at 16 and 64 nodes and the planner's
choice are then predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from megatron.performance_model import (  # noqa: E402
    GPT2_PAPER, P100_ARIES, ModelSpec, evaluate, launch_flags, load_profile, network_contention,
    pipedream_2bw_time, search_configurations)

BERT48 = ModelSpec(num_layers=48, hidden_size=1024, num_attention_heads=16, seq_length=128,
                   vocab_size=30522, max_position_embeddings=512)

#: (label, scheme, W, D, B, N, recompute, published seq/s) at 512 nodes, mini-batch 512.
SWEEP_512 = (("W=8 D=64", "chimera-direct", 8, 64, 1, 64, "none", 117),
             ("W=16 D=32", "chimera-direct", 16, 32, 1, 32, "none", 140),
             ("W=32 D=16 recompute", "chimera-direct", 32, 16, 1, 16, "full", 129),
             ("W=64 D=8 recompute", "chimera-direct", 64, 8, 1, 8, "full", 143))
#: The same at 2,048 nodes, mini-batch 2,048 (B of the baselines: 1 unless the paper says).
COMPARISON_2048 = (("Chimera D=32", "chimera-direct", 64, 32, 1, 32, "none", 513),
                   ("PipeDream-2BW D=16", "pipedream-2bw", 128, 16, 1, 16, "full", 440),
                   ("1F1B/DAPPLE D=16", "1f1b", 128, 16, 1, 16, "full", 372),
                   ("GPipe D=8", "gpipe", 256, 8, 1, 8, "full", 361),
                   ("PipeDream D=8", "pipedream", 256, 8, 1, 8, "none", 256),
                   ("GEMS D=8 B=2", "gems", 256, 8, 2, 4, "none", 220))
WEAK_SCALING = ((512, 140), (1024, 279), (2048, 513))  # Chimera D=32, B=1, N=32
SYNC_POLICY = ((16, 1.01), (32, 1.09), (64, 1.10))  # Bert-48 D=4 B=8 N=8: eager-opt speedup
#: Values the coordinate-descent fit tries for each fitted constant (``fit_constants``).
FIT_GRID = {"efficiency": (0.30, 0.35, 0.40, 0.45, 0.50),
            "op_overhead_seconds": (0.0, 0.005, 0.0075, 0.010, 0.0125, 0.015, 0.020),
            "bandwidth": (3e9, 4e9, 5e9, 6.5e9, 8e9, 10e9),
            "global_bandwidth_fraction": (0.15, 0.2, 0.25, 0.3, 0.35, 0.45, 0.6, 1.0),
            "overlap_slowdown": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)}
#: Points the fit sees (in-sample). Everything else in the report is a prediction.
IN_SAMPLE = ("512-node sweep (4 points)", "Chimera weak scaling at 1,024 and 2,048 nodes "
             "(so the 2,048-node Chimera row is in-sample)", "sync policy at 32 nodes")
HELD_OUT = ("512-node sweep (4 points)", "Chimera weak scaling at 1,024 nodes (2,048 held out)",
            "sync policy at 32 nodes")


#: Rows of the tables that the fit sees (the weak-scaling series includes Chimera at 2,048 nodes).
IN_SAMPLE_ROWS = frozenset(row[0] for row in SWEEP_512) | {"Chimera D=32"}


def predict(hardware, row, model=GPT2_PAPER, policy="eager-opt") -> float:
    _, scheme, width, depth, size, count, recompute, _ = row
    return evaluate(model, hardware, scheme, width, depth, size, count, recompute,
                    policy).throughput


def residual_rows(hardware, rows) -> list:
    """(label, predicted, published, relative error, fits in memory) per row."""
    table = []
    for row in rows:
        estimate = evaluate(GPT2_PAPER, hardware, *row[1:7])
        table.append((row[0], estimate.throughput, row[7],
                      estimate.throughput / row[7] - 1, estimate.fits))
    return table


def with_constants(base, efficiency, op_overhead_seconds, bandwidth, global_bandwidth_fraction,
                   overlap_slowdown):
    """``base`` with the five fitted constants replaced (peak 9.3 TFLOP/s of a P100)."""
    return dataclasses.replace(base, flops_per_second=9.3e12 * efficiency, beta=1 / bandwidth,
                               op_overhead_seconds=op_overhead_seconds,
                               global_bandwidth_fraction=global_bandwidth_fraction,
                               overlap_slowdown=overlap_slowdown)


def fit_error(hardware, hold_out_2048: bool = False) -> float:
    """Largest relative error over the in-sample points (``IN_SAMPLE``). The sweep's ranking is
    not part of it: its top two differ by 2 % in the paper, and the paper's own model ranks
    them the other way too (149 vs 143 predicted, chimera.md §8). ``hold_out_2048``: leave the
    2,048-node weak-scaling point out (a hold-out check of the contention term)."""
    sweep = residual_rows(hardware, SWEEP_512)
    errors = [abs(row[3]) for row in sweep]
    errors += [abs(predicted / published - 1) for nodes, predicted, published
               in weak_scaling(hardware) if nodes > 512 and not (hold_out_2048 and nodes == 2048)]
    errors += [abs(ratio / published - 1) for nodes, ratio, published
               in sync_policy_ratios(hardware, nodes=(32,))]
    return max(errors)


def fit_constants(base=P100_ARIES, rounds: int = 3, hold_out_2048: bool = False):
    """Coordinate descent over ``FIT_GRID`` from ``base``'s constants, on the in-sample points
    only; returns (hardware, error). Each round tries every grid value of one constant with
    the others fixed, for each constant in turn (~15 s per round on one core)."""
    current = {"efficiency": base.flops_per_second / 9.3e12,
               "op_overhead_seconds": base.op_overhead_seconds, "bandwidth": 1 / base.beta,
               "global_bandwidth_fraction": base.global_bandwidth_fraction,
               "overlap_slowdown": base.overlap_slowdown}
    best_error = fit_error(with_constants(base, **current), hold_out_2048)
    for _ in range(rounds):
        for name, values in FIT_GRID.items():
            for value in values:
                trial = dict(current, **{name: value})
                error = fit_error(with_constants(base, **trial), hold_out_2048)
                if error < best_error - 1e-9:
                    current, best_error = trial, error
    return with_constants(base, **current), best_error


def weak_scaling(hardware) -> list:
    rows = []
    for nodes, published in WEAK_SCALING:
        row = ("", "chimera-direct", nodes // 32, 32, 1, 32, "none", published)
        rows.append((nodes, predict(hardware, row), published))
    return rows


def sync_policy_ratios(hardware, nodes=None) -> list:
    """(nodes, predicted eager-opt / eager throughput, published) for Bert-48, D=4, B=8, N=8;
    ``nodes``: only these node counts."""
    rows = []
    for count, published in SYNC_POLICY:
        if nodes is not None and count not in nodes:
            continue
        row = ("", "chimera-direct", count // 4, 4, 8, 8, "none", 0)
        ratio = (predict(hardware, row, BERT48, "eager-opt")
                 / predict(hardware, row, BERT48, "eager"))
        rows.append((count, ratio, published))
    return rows


def two_bw_drain_diagnostic(hardware) -> str:
    """PipeDream-2BW D=16 if its implementation drained the pipeline every step (not Table 2's
    scheme, so not the prediction): shows which term the measured number is consistent with."""
    row = next(r for r in COMPARISON_2048 if r[1] == "pipedream-2bw")
    costs = evaluate(GPT2_PAPER, hardware, *row[1:7]).costs
    drained = row[2] * row[4] * row[5] / pipedream_2bw_time(row[3], row[5], costs,
                                                            drains_each_step=True)
    return (f"  diagnostic: PipeDream-2BW D=16 with a fill/drain every step would give "
            f"{drained:.1f} seq/s ({drained / row[7] - 1:+.1%}); not used as the prediction")


def planner_choice(hardware):
    """Top configuration over Chimera shapes at 2,048 nodes, mini-batch 2,048 (B searched)."""
    return search_configurations(GPT2_PAPER, hardware, 2048, 2048, schemes=("chimera-direct",),
                                 shapes=[(2048 // d, d) for d in (8, 16, 32, 64)])[0]


def format_residuals(title, rows, in_sample=IN_SAMPLE_ROWS) -> str:
    """A predicted-vs-published table; the last column says whether the fit saw the row."""
    lines = [title, f"{'configuration':<24}{'predicted':>10}{'published':>10}{'error':>8}  fits"
                    "  sample"]
    for label, predicted, published, error, fits in rows:
        sample = "in" if label in in_sample else "out"
        lines.append(f"{label:<24}{predicted:>10.1f}{published:>10.0f}{error:>+8.1%}  "
                     f"{'yes' if fits else 'NO ':<4}  {sample}")
    return "\n".join(lines)


def ranking(rows) -> tuple:
    predicted = [r[0] for r in sorted(rows, key=lambda r: -r[1])]
    published = [r[0] for r in sorted(rows, key=lambda r: -r[2])]
    return predicted, published


def report(hardware, hold_out_2048: bool = False) -> str:
    sweep = residual_rows(hardware, SWEEP_512)
    predicted_order, published_order = ranking(sweep)
    comparison = residual_rows(hardware, COMPARISON_2048)
    chimera = comparison[0][1]
    out = [assumptions(hardware, hold_out_2048), "",
           format_residuals("512-node sweep, mini-batch 512 (seq/s)", sweep),
           f"ranking predicted: {' > '.join(predicted_order)}",
           f"ranking published: {' > '.join(published_order)}", "",
           format_residuals("2,048 nodes, mini-batch 2,048 (seq/s)", comparison,
                            IN_SAMPLE_ROWS - {"Chimera D=32"} if hold_out_2048 else IN_SAMPLE_ROWS),
           two_bw_drain_diagnostic(hardware),
           "Chimera speedup predicted / published: " + ", ".join(
               f"{r[0].split()[0]} {chimera / r[1]:.2f}x/{513 / r[2]:.2f}x" for r in comparison[1:])]
    scaling = weak_scaling(hardware)
    fitted_nodes = "1,024 nodes" if hold_out_2048 else "1,024 and 2,048 nodes"
    out += ["", f"weak scaling, Chimera D=32 (seq/s, predicted/published; {fitted_nodes} "
            "in-sample): " + ", ".join(f"{n} nodes {p:.0f}/{q}" for n, p, q in scaling),
        f"efficiency 512 -> 2,048 nodes: predicted {scaling[2][1] / (4 * scaling[0][1]):.1%}, "
        f"published {513 / (4 * 140):.1%}", "",
        "sync policy, Bert-48 D=4 B=8 N=8, eager-opt over eager (predicted/published; 32 nodes "
        "in-sample): " + ", ".join(
            f"{n} nodes {p:.2f}x/{q:.2f}x" for n, p, q in sync_policy_ratios(hardware))]
    best = planner_choice(hardware)
    out += ["", f"planner's top choice at 2,048 nodes: W={best.data_parallel} D={best.pipeline} "
            f"B={best.micro_batch_size} recompute={best.recompute} "
            f"({best.throughput:.0f} seq/s); paper: W=64 D=32 (out-of-sample)",
            f"launch flags: {launch_flags(best)}"]
    return "\n".join(out)


def assumptions(hardware, hold_out_2048: bool = False) -> str:
    contention = ", ".join(f"{nodes} nodes x{network_contention(hardware, nodes):.2f}"
                           for nodes in (512, 1024, 2048))
    return "\n".join([
        "Assumptions: GPT-2 64 layers, h=1280, 20 heads, s=632, V=50257, untied, fp32; one P100 "
        "per node; B=1 unless stated; balanced stages (F = model FLOPs / D); Cp2p on every "
        "critical-path op; Rabenseifner all-reduce; concurrent syncs on a rank share its link; "
        f"dragonfly contention of all-reduces: groups of {hardware.nodes_per_group} nodes, a node "
        f"gets gamma = {hardware.global_bandwidth_fraction:.2f} of its injection bandwidth across "
        f"groups, slowdown max(1, (1 - G/P)/gamma): {contention} (p2p stays inside a group); "
        f"compute under an in-flight sync runs {1 + hardware.overlap_slowdown:.2f}x slower "
        "(sigma); GEMS/PipeDream/2BW analytic (baselines.py).",
        f"Constants: sustained {hardware.flops_per_second / 1e12:.2f} TFLOP/s, op overhead "
        f"{hardware.op_overhead_seconds * 1e3:.1f} ms, link {1 / hardware.beta / 1e9:.1f} GB/s, "
        f"gamma {hardware.global_bandwidth_fraction:.2f}, sigma {hardware.overlap_slowdown:.2f} "
        f"(these five FITTED on: {'; '.join(HELD_OUT if hold_out_2048 else IN_SAMPLE)}); "
        "half-efficiency "
        f"{hardware.half_efficiency_tokens:.0f} tokens, alpha {hardware.alpha * 1e6:.0f} us, "
        f"group {hardware.nodes_per_group} nodes (stated); memory "
        f"{hardware.device_memory_bytes / 1e9:.0f} GB with "
        f"{hardware.framework_overhead_bytes / 1e9:.1f} GB framework overhead (fitted on the "
        "paper's recomputation decisions). All other rows are out-of-sample predictions."])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true",
                        help="refit the five constants on the in-sample points first (~45 s)")
    parser.add_argument("--hold-out-2048", action="store_true",
                        help="with --fit: leave the 2,048-node weak-scaling point out of the fit, "
                        "so every 2,048-node row is a prediction")
    parser.add_argument("--profile", default=None,
                        help="hardware profile JSON (tools/performance_model.py --measure); "
                        "default: the shipped P100_ARIES profile")
    args = parser.parse_args(argv)
    hardware = load_profile(args.profile) if args.profile else P100_ARIES
    if args.hold_out_2048 and not args.fit:
        parser.error("--hold-out-2048 changes what --fit sees: give --fit too")
    if args.fit:
        hardware, error = fit_constants(hardware, hold_out_2048=args.hold_out_2048)
        print(f"fitted on the in-sample points: largest error {error:.1%}")
    print(report(hardware, args.hold_out_2048))
    return 0


if __name__ == "__main__":
    sys.exit(main())
