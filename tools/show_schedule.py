#!/usr/bin/env python
"""Draw a pipeline schedule: text grid, CSV, Chrome trace (Perfetto) or PNG timeline.

Builds the schedule with the project's builders, validates it, lowers it (point-to-point groups
and gradient syncs, exactly what the runtime executes) and simulates all ranks with the given
costs. Examples:

    python tools/show_schedule.py --schedule chimera --pipeline-model-parallel-size 4 \\
        --num-microbatches 4 --backward-cost 2
    python tools/show_schedule.py --schedule 1f1b --pipeline-model-parallel-size 8 \\
        --num-microbatches 16 --format json --output 1f1b.json   # open in ui.perfetto.dev

Text: one column per time unit (the largest unit dividing all costs), one row per pipeline
rank, then makespan, bubble ratio (idle compute time / total time over ranks) and peak stored
activations per rank. Labels: F/B + micro-batch, then for Chimera 'v' (down) or '^' (up)
followed by the pipeline pair index when there are more than two pipelines, for interleaved
1F1B 'c' + model chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.pipeline_parallel.planning.grid import format_time_grid, time_unit  # noqa: E402
from megatron.core.pipeline_parallel.planning.instructions import (  # noqa: E402
    Instruction, format_schedule_csv)
from megatron.core.pipeline_parallel.planning.lowering import GRAD_SYNC_POLICIES  # noqa: E402
from megatron.core.pipeline_parallel.planning.plan import make_plan  # noqa: E402
from megatron.core.pipeline_parallel.planning.schedules import (  # noqa: E402
    BUILTIN_SCHEDULES, check_schedule_options, family_options)
from megatron.core.pipeline_parallel.planning.simulator import simulate_plan  # noqa: E402

FORMATS = ("text", "csv", "json", "png")
# Colours per pipeline (down pipelines blue-ish, up pipelines orange-ish), forward lighter.
_PIPELINE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                     "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def parse_args(argv=None, registry=BUILTIN_SCHEDULES) -> argparse.Namespace:
    """This tool's flags; ``--schedule`` and the schedule option flags come from ``registry``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=registry.names, default=registry.default_name)
    parser.add_argument("--pipeline-model-parallel-size", type=int, required=True,
                        help="Pipeline depth D.")
    parser.add_argument("--num-microbatches", type=int, required=True,
                        help="Micro-batches N per data-parallel rank per iteration.")
    for option in registry.tool_options():
        parser.add_argument(option.flag, dest=option.name, type=option.type,
                            choices=option.choices, default=option.default_for_tools,
                            help=option.help)
    parser.add_argument("--forward-cost", type=float, default=1.0,
                        help="Time of one forward of one stage on one micro-batch.")
    parser.add_argument("--backward-cost", type=float, default=2.0,
                        help="Time of one backward of one stage on one micro-batch.")
    parser.add_argument("--p2p-cost", type=float, default=0.0,
                        help="Time of one point-to-point group.")
    parser.add_argument("--allreduce-cost", type=float, default=0.0,
                        help="Time of one stage's gradient all-reduce.")
    parser.add_argument("--grad-sync", choices=GRAD_SYNC_POLICIES, default="eager-opt",
                        help="When Chimera starts a stage's gradient all-reduce.")
    parser.add_argument("--split-backward", action="store_true",
                        help="Split each backward into I (input gradient) and W (weight "
                             "gradient) and move the W ops into idle slots (costs: I = W = B/2; a "
                             "first stage's I = 0 and W = B).")
    parser.add_argument("--split-backward-extra-activations", type=int, default=0,
                        help="With --split-backward: extra stored micro-batches allowed above "
                             "the busiest rank's peak (0: peak memory unchanged).")
    parser.add_argument("--format", choices=FORMATS, default="text")
    parser.add_argument("--output", default=None,
                        help="Output file (default: standard output; required for png).")
    args = parser.parse_args(argv)
    if args.format == "png" and not args.output:
        parser.error("--format png needs --output FILE.png")
    try:
        check_schedule_options(args.schedule, args.pipeline_model_parallel_size,
                               args.num_microbatches, registry=registry,
                               **schedule_options(args, registry))
    except ValueError as error:
        parser.error(str(error))
    return args


def schedule_options(args, registry=BUILTIN_SCHEDULES) -> dict:
    """The builder options of ``--schedule`` from this tool's flags."""
    given = {option.name: getattr(args, option.name) for option in registry.tool_options()}
    return family_options(args.schedule, registry, **given)


def describe(args, plan) -> str:
    parts = [f"{args.schedule}", f"D={args.pipeline_model_parallel_size}",
             f"N={args.num_microbatches}"]
    parts += [f"{name}={value}" for name, value in plan.options.items()]
    if plan.layout.has_stage_replicas:
        parts.append(f"grad-sync={args.grad_sync}")
    if plan.split_backward is not None:
        parts.append(f"split-backward(+{plan.split_backward})")
    parts += [f"F={args.forward_cost:g}", f"B={args.backward_cost:g}"]
    return " ".join(parts)


def _number(value: float) -> str:
    return f"{value:g}" if abs(value - round(value)) > 1e-9 else str(int(round(value)))


def render_text(args, plan, result) -> str:
    layout = plan.layout
    timelines = [[(entry.op, entry.start, entry.end) for entry in timeline]
                 for timeline in result.compute_timelines()]
    # one column = the largest unit dividing every duration and start (p2p costs shift starts)
    unit = time_unit([value for timeline in timelines for _, start, end in timeline
                      for value in (end - start, start)])
    grid = format_time_grid(
        timelines, unit, label=lambda op: plan.op_label(op),
        makespan=result.makespan)
    fraction = layout.microbatch_fraction
    peaks = " ".join(str(peak) for peak in result.peak_activations)
    lines = [f"# {describe(args, plan)} (one column = {_number(float(unit))} time units)", grid,
             f"makespan {_number(result.makespan)}",
             f"bubble ratio {result.bubble_ratio:.4f}",
             f"peak activations per rank (micro-batches): {peaks}"]
    if fraction != 1:
        lines[-1] = (f"peak activations per rank (half micro-batches of size B/2): {peaks}")
    return "\n".join(lines) + "\n"


def render_json(args, plan, result) -> str:
    """Chrome trace events (open in https://ui.perfetto.dev or chrome://tracing)."""
    microseconds_per_unit = 1000.0
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": describe(args, plan)}}]
    for rank, timeline in enumerate(result.timelines):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"pipeline rank {rank}"}})
        for entry in timeline:
            op = entry.op
            event = {"name": str(op), "ph": "X", "pid": 0, "tid": rank,
                     "ts": entry.start * microseconds_per_unit,
                     "dur": (entry.end - entry.start) * microseconds_per_unit}
            if isinstance(op, Instruction):
                event["name"] = plan.op_label(op)
                event["cat"] = "forward" if op.kind.is_forward else "backward"
                event["args"] = {"instruction": str(op), "pipeline": op.pipeline,
                                 "stage": op.stage, "microbatch": op.microbatch}
            else:
                event["cat"] = type(op).__name__
            events.append(event)
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"makespan": result.makespan,
                                     "bubble_ratio": result.bubble_ratio,
                                     "peak_activations": result.peak_activations}}, indent=1)


def render_png(args, plan, result, path: str) -> None:
    import matplotlib  # lazily: only the png format needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timelines = result.compute_timelines()
    figure_width = max(6.0, min(40.0, result.makespan * 0.35))
    figure, axes = plt.subplots(figsize=(figure_width, 0.5 * len(timelines) + 1.2))
    for rank, timeline in enumerate(timelines):
        for entry in timeline:
            op = entry.op
            colour = _PIPELINE_COLOURS[op.pipeline % len(_PIPELINE_COLOURS)]
            axes.barh(rank, entry.end - entry.start, left=entry.start, height=0.8,
                      color=colour, alpha=0.45 if op.kind.is_forward else 0.95,
                      edgecolor="black", linewidth=0.5)
            axes.text((entry.start + entry.end) / 2, rank,
                      plan.op_label(op),
                      ha="center", va="center", fontsize=7)
    axes.set_yticks(range(len(timelines)))
    axes.set_yticklabels([f"P{rank}" for rank in range(len(timelines))])
    axes.invert_yaxis()
    axes.set_xlim(0, result.makespan)
    axes.set_xlabel("time")
    axes.set_title(f"{describe(args, plan)}\nmakespan {_number(result.makespan)}, "
                   f"bubble ratio {result.bubble_ratio:.3f} (light = forward, dark = backward)",
                   fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None, registry=BUILTIN_SCHEDULES) -> int:
    args = parse_args(argv, registry)
    plan = make_plan(args.schedule, args.pipeline_model_parallel_size, args.num_microbatches,
                     schedule_options(args, registry), grad_sync_policy=args.grad_sync,
                     forward_cost=args.forward_cost, backward_cost=args.backward_cost,
                     split_backward=(args.split_backward_extra_activations
                                     if args.split_backward else None),
                     registry=registry)
    result = simulate_plan(plan, args.forward_cost, args.backward_cost, args.p2p_cost,
                           args.allreduce_cost)
    if args.format == "png":
        render_png(args, plan, result, args.output)
        return 0
    if args.format == "text":
        text = render_text(args, plan, result)
    elif args.format == "csv":
        text = format_schedule_csv(plan.schedule)
    else:
        text = render_json(args, plan, result)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
