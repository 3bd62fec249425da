#!/usr/bin/env python
"""Which ops of an emulated pipeline iteration start late against the plan, and why.

    python benchmarks/emulated_lateness.py                                # D = 4, N = 8, 80 ms
    python benchmarks/emulated_lateness.py --only "chimera split" --unit-ms 20 --iterations 3

Runs configurations of benchmarks/emulated_depth.py (same sleeping stages, real gloo messages, real
stage all-reduces) with the interpreter's timeline on every iteration, and aligns every rank's
measured compute ops with the simulator's timeline of the same lowered plan (free messages, the
emulated per-stage charges). All times are CLOCK_MONOTONIC, one clock for the processes of one
host; the origin is the earliest rank's start of the op list (the simulation starts every rank at
0). Per compute op: lateness = measured start - simulated start. It changes from op to op only by

* **overrun**: the op ran longer than charged (sleep overshoot, the module's and autograd's work,
  a wait for a core);
* **local gap**: measured idle before the op on its own rank when its input was already there
  (posting the P2P groups between ops, prefetching receives, the interpreter) minus the plan's idle
  there;
* **message**: where the op waited for its input, the sender's lateness when its producing op
  ended, plus the lag from that end to the send post, plus the hop (send post -> input ready),
  minus the plan's slack between producer end and consumer start.

The critical path is walked back from the op that ends last (per op: its input message if it
waited longer than ``--waited-ms`` for it, else its predecessor on the rank); its lateness is
split into those terms summed along the path. Then the tail: measured list end -> iteration end
(the stage all-reduce wait, SGD), which the free simulation charges nothing for. Printed per
configuration: medians over iterations of each term, the ops with the largest lateness
increments, and the delay of every message a consumer waited for (send post -> data in hand,
median and p90, and how many of their receives were posted only after the send). docs/benchmarks.md §9 ("Where the plans lose time, op by op") has a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.path.dirname(os.path.abspath(
        __file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import _emulated_stages  # noqa: E402
import _thread_cpu  # noqa: E402
import emulated_depth  # noqa: E402

from megatron.core.pipeline_parallel.planning.lowering import SEND  # noqa: E402
from megatron.core.pipeline_parallel.planning.simulator import simulate_plan  # noqa: E402


def _rank(rank, world_size, labels, times, sizes, count, iterations):
    """Per label: per recorded iteration this rank's (start, op-list origin, compute and wait
    records, message records, list end, iteration end, all-reduce wait)."""
    import logging

    import torch.distributed as dist
    from _harness import parallel_state_for

    from megatron.core.runtimes import pipeline as pipeline_runtime
    from megatron.core.runtimes.pipeline import PipelineRuntime
    from megatron.training.arguments import parse_args
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    # write_timeline gathers every rank's records after the list (a collective): not here.
    pipeline_runtime.write_timeline = lambda *args, **kwargs: None  # this worker process only
    variants = dict(emulated_depth.our_variants(world_size))
    state = parallel_state_for(rank, world_size, [emulated_depth._config_flags(world_size, count)
                                                  + flags for flags in variants.values()])
    floats_per_layer, activation_floats = sizes
    results = {}
    for label in labels:
        config = parse_args(emulated_depth.our_flags(variants[label], world_size, count, times)
                            + ["--pipeline-timeline", os.devnull], world_size=world_size)
        runtime = PipelineRuntime(config, state, torch.device("cpu"))
        runtime.log = lambda *args, **kwargs: None

        def provider(config, parallel_state, *, pre_process=True, post_process=True,
                     layer_range=None):
            return _emulated_stages.EmulatedStage(times, layer_range, pre_process, post_process,
                                                  floats_per_layer, activation_floats)

        chunks = runtime.build_model_chunks(provider)
        reducers = runtime.build_gradient_reducers(chunks)
        optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-3)
        microbatches = [{"x": torch.ones(1, activation_floats)} for _ in range(count)]

        def forward_step(microbatch, chunk):
            return chunk(microbatch["x"]), lambda out: (_emulated_stages.emulated_loss(out), {})

        rows = []
        for iteration in range(iterations + 1):  # the first warms up
            runtime.timeline_iteration = runtime.iterations + 1
            dist.barrier()
            start = time.perf_counter()
            # the runtime zeroes the gradients where it has time, as in emulated_depth.py
            runtime.forward_backward(forward_step_func=forward_step, model_chunks=chunks,
                                     microbatches=microbatches, scale_loss=lambda loss: loss,
                                     gradient_reducers=reducers, forward_only=False,
                                     zero_grad=lambda: [reducer.zero_grad() for reducer in reducers])
            list_end = time.perf_counter()
            for reducer in reducers:
                reducer.wait()
            reduced = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            dist.barrier()
            interpreter = runtime.last_interpreter
            if iteration:
                rows.append({"start": start, "origin": interpreter._origin,
                             "records": [(r.op, r.start, r.end) for r in interpreter.timeline],
                             "messages": [(m.key, m.side, m.produced, m.posted, m.returned)
                                          for m in interpreter.messages],
                             "list_end": list_end, "reduced": reduced, "end": end})
        results[label] = rows
    return results


def _is_compute(name: str) -> bool:
    return name[:1] in "FBIW" and name[1:2].isdigit()


def _op_fields(name: str) -> tuple:
    parts = name[1:].split(".")
    return name[0], int(parts[0]), int(parts[1]), int(parts[2])


def analyse(per_rank_rows: list, simulated, waited: float) -> dict:
    """One iteration: every rank's rows (see _rank) against the simulation's timelines."""
    origin = min(row["origin"] for row in per_rank_rows)
    ops = []  # per rank: list of dicts
    for rank, row in enumerate(per_rank_rows):
        base = row["origin"] - origin
        sim = [e for e in simulated.timelines[rank] if _is_compute(str(e.op))]
        measured = []
        pending_wait = pending_post = 0.0
        for name, start, end in row["records"]:
            if _is_compute(name):
                measured.append((name, base + start, base + end, pending_wait, pending_post))
                pending_wait = pending_post = 0.0
            elif name.startswith("wait ") and name != "wait sends":
                pending_wait += end - start
            elif name.startswith("["):
                pending_post += end - start
        if [str(e.op) for e in sim] != [m[0] for m in measured]:
            raise RuntimeError(f"rank {rank}: measured op order differs from the plan")
        rank_ops = []
        for entry, (name, start, end, wait, post) in zip(sim, measured):
            rank_ops.append({"rank": rank, "name": name, "start": start, "end": end,
                             "wait": wait, "post": post, "sim_start": entry.start,
                             "sim_end": entry.end})
        ops.append(rank_ops)
    sends, receives = {}, {}
    for rank, row in enumerate(per_rank_rows):
        for key, side, produced, posted, returned in row["messages"]:
            (sends if side == "send" else receives)[key] = (rank, produced, posted - origin,
                                                            returned - origin)
    # the plan's send post of every message: when the sender reaches its P2P group
    sim_posted = {}
    for rank_timeline in simulated.timelines:
        for entry in rank_timeline:
            for p2p in getattr(entry.op, "ops", ()):
                if p2p.direction == SEND:
                    message = p2p.message
                    sim_posted[(message.kind, message.pipeline, message.stage,
                                message.microbatch)] = entry.start
    # consumer op -> its waited message (key)
    consumer_of = {}
    for rank_ops in ops:
        for op in rank_ops:
            kind, pipeline, stage, microbatch = _op_fields(op["name"])
            if kind == "F":
                candidates = [k for k in receives if str(k[0]).lower().startswith("a")
                              and k[1:] == (pipeline, stage - 1, microbatch)]
            elif kind in "BI":
                candidates = [k for k in receives if str(k[0]).lower().startswith("g")
                              and k[1:] == (pipeline, stage + 1, microbatch)]
            else:
                candidates = []
            candidates = [k for k in candidates if receives[k][0] == op["rank"]]
            if candidates:
                consumer_of[(op["rank"], op["name"])] = candidates[0]

    def producer_op(key):
        rank = sends[key][0]
        _, pipeline, stage, microbatch = key
        letters = "F" if str(key[0]).lower().startswith("a") else "BI"
        for op in ops[rank]:
            kind, p, s, m = _op_fields(op["name"])
            if kind in letters and (p, s, m) == (pipeline, stage, microbatch):
                return op
        raise RuntimeError(f"no producer of {key}")

    terms = {"overrun": 0.0, "local gap": 0.0, "post lag": 0.0, "hop": 0.0, "slack": 0.0,
             "start": 0.0}
    path = []
    steps: list = []
    hops_on_path = 0
    last = max((op for rank_ops in ops for op in rank_ops), key=lambda op: op["end"])
    current = last
    while True:
        terms["overrun"] += (current["end"] - current["start"]) - (current["sim_end"]
                                                                   - current["sim_start"])
        path.append(current)
        key = consumer_of.get((current["rank"], current["name"]))
        rank_ops = ops[current["rank"]]
        index = rank_ops.index(current)
        if key is not None and current["wait"] > waited:
            producer = producer_op(key)
            posted = sends[key][2]
            hops_on_path += 1
            # the plan posts the send sim_posted[key] - sim_end after the producer: only the
            # measured lag beyond that is late
            planned_lag = sim_posted[key] - producer["sim_end"]
            terms["post lag"] += posted - producer["end"] - planned_lag
            terms["hop"] += current["start"] - posted
            terms["slack"] -= current["sim_start"] - sim_posted[key]
            steps.append(f"{current['name']}<-r{producer['rank']}:{producer['name']} lag+"
                         f"{(posted - producer['end'] - planned_lag) * 1e3:.1f} hop "
                         f"{(current['start'] - posted) * 1e3:.1f} over "
                         f"{(current['end'] - current['start'] - current['sim_end'] + current['sim_start']) * 1e3:.1f}")
            current = producer
        elif index > 0:
            previous = rank_ops[index - 1]
            gap = current["start"] - previous["end"]
            sim_gap = current["sim_start"] - previous["sim_end"]
            terms["local gap"] += gap
            terms["slack"] -= sim_gap
            steps.append(f"{current['name']} gap {gap * 1e3:.1f} (plan {sim_gap * 1e3:.0f}) over "
                         f"{(current['end'] - current['start'] - current['sim_end'] + current['sim_start']) * 1e3:.1f}")
            current = previous
        else:
            terms["start"] += current["start"] - current["sim_start"]
            break
    list_end = max(row["list_end"] for row in per_rank_rows) - origin
    end = max(row["end"] for row in per_rank_rows) - origin
    increments = []
    for rank_ops in ops:
        previous_late = 0.0
        for op in rank_ops:
            late = op["start"] - op["sim_start"]
            increments.append((late - previous_late, late, op["rank"], op["name"], op["wait"]))
            previous_late = op["end"] - op["sim_end"]
    overruns = {}
    for rank_ops in ops:
        for op in rank_ops:
            overruns.setdefault(op["name"][0], []).append(
                (op["end"] - op["start"]) - (op["sim_end"] - op["sim_start"]))
    # every op whose input was there (waited <= ``waited``): its gap to the previous op on the
    # rank, split into posting P2P groups, taking the (arrived) input and the rest
    gaps = {"gap": [], "posting": [], "input": []}
    for rank_ops in ops:
        for previous, op in zip(rank_ops, rank_ops[1:]):
            if op["wait"] <= waited and op["sim_start"] - previous["sim_end"] <= 1e-9:
                gaps["gap"].append(op["start"] - previous["end"])
                gaps["posting"].append(op["post"])
                gaps["input"].append(op["wait"])
    reduce_waits = [row["reduced"] - row["list_end"] for row in per_rank_rows]
    # every message its consumer waited for (longer than ``waited``): send post -> data in hand,
    # and whether the receive was posted only after the send (then gloo's rendezvous adds a trip)
    waited_hops, late_receives = [], 0
    for key, (_, receive_posted, asked, returned) in receives.items():
        if key in sends and returned - asked > waited:
            send_posted = sends[key][2]
            waited_hops.append(returned - send_posted)
            late_receives += receive_posted - origin > send_posted
    return {"makespan": simulated.makespan, "last_end": last["end"],
            "late_at_end": last["end"] - last["sim_end"], "terms": terms,
            "path_ops": len(path), "path_hops": hops_on_path, "list_end": list_end, "end": end,
            "tail": end - last["end"], "reduce_wait_max": max(reduce_waits),
            "optimizer_max": max(row["end"] - row["reduced"] for row in per_rank_rows),
            "waited_hops": waited_hops, "late_receives": late_receives,
            "increments": sorted(increments, reverse=True)[:6],
            "overrun_mean": {k: statistics.mean(v) for k, v in overruns.items()},
            "gap_mean": {k: statistics.mean(v) if v else 0.0 for k, v in gaps.items()},
            "path": [(op["rank"], op["name"]) for op in path[::-1]], "steps": steps[::-1]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(label, analyses, verbose: bool = False) -> str:
    def med(getter):
        return statistics.median(getter(a) for a in analyses)
    first = analyses[0]
    lines = [f"{label}: simulated {_ms(first['makespan'])} ms; measured last op end "
             f"{_ms(med(lambda a: a['last_end']))}, iteration end {_ms(med(lambda a: a['end']))}"
             f" (m/s {first['makespan'] / med(lambda a: a['end']):.3f})"]
    terms = list(first["terms"])
    lines.append("  critical path (median over iterations, ms): late at last op end "
                 f"{_ms(med(lambda a: a['late_at_end']))} = " + " + ".join(
                     f"{name} {_ms(med(lambda a, n=name: a['terms'][n]))}" for name in terms)
                 + f"; path of {first['path_ops']} ops, {first['path_hops']} of them gated by a message")
    lines.append(f"  tail: last op end -> iteration end {_ms(med(lambda a: a['tail']))} ms "
                 f"(all-reduce wait after the list, max over ranks "
                 f"{_ms(med(lambda a: a['reduce_wait_max']))} ms, then the optimizer step, max "
                 f"{_ms(med(lambda a: a['optimizer_max']))} ms)")
    hops = sorted(hop for a in analyses for hop in a["waited_hops"])
    if hops:
        lines.append(f"  waited messages (all iterations): {len(hops)}, send post -> data in hand "
                     f"median {_ms(statistics.median(hops))} ms, p90 "
                     f"{_ms(hops[int(0.9 * (len(hops) - 1))])} ms; receive posted after the send: "
                     f"{sum(a['late_receives'] for a in analyses)}")
    lines.append("  mean overrun per op kind (ms): " + ", ".join(
        f"{k} {_ms(statistics.median(a['overrun_mean'].get(k, 0.0) for a in analyses))}"
        for k in sorted(first["overrun_mean"])))
    gap = {k: statistics.median(a["gap_mean"][k] for a in analyses) for k in first["gap_mean"]}
    lines.append(f"  mean gap before an op whose input was there (ms): {gap['gap'] * 1e3:.2f} = "
                 f"posting P2P groups {gap['posting'] * 1e3:.2f} + taking the input "
                 f"{gap['input'] * 1e3:.2f} + the rest (interpreter, prefetching receives) "
                 f"{(gap['gap'] - gap['posting'] - gap['input']) * 1e3:.2f}")
    lines.append("  largest lateness increments (first iteration): " + "; ".join(
        f"r{rank} {name} +{_ms(inc)} (late {_ms(late)}, waited {_ms(wait)})"
        for inc, late, rank, name, wait in first["increments"]))
    lines.append("  path: " + " ".join(f"r{r}:{n}" for r, n in first["path"]))
    if verbose:
        lines += [f"    {step}" for step in first["steps"]]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--count", type=int, default=2, help="N = count x D (default 2)")
    parser.add_argument("--unit-ms", type=float, default=80.0)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=None,
                        help="labels containing any of these words (default: every one of ours)")
    parser.add_argument("--waited-ms", type=float, default=1.0,
                        help="an op whose input wait exceeded this was gated by its message")
    parser.add_argument("--timer-slack-ns", type=int, default=None,
                        help="Linux timer slack of every rank, set before they start "
                             "(see emulated_depth.py); default: leave it")
    parser.add_argument("--verbose", action="store_true",
                        help="print every step of the first iteration's critical path")
    parser.add_argument("--thread-cpu", type=int, nargs="?", const=10, default=None,
                        metavar="WINDOWS",
                        help="poll every rank thread's CPU and run-queue time (Linux /proc) and "
                             "print, over WINDOWS equal windows of each configuration's last "
                             "iteration (default 10), the cores used by main threads, gloo's "
                             "TCP loops and its collective workers, and the ops' overrun")
    parser.add_argument("--param-floats", type=int, default=1 << 20,
                        help="parameter floats per stage of 1/D of the model (as in "
                             "emulated_depth.py)")
    parser.add_argument("--activation-floats", type=int, default=1 << 14)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from dist_harness import run_distributed
    args = parse_args(argv)
    depth, count = args.depth, args.count * args.depth
    times = emulated_depth.equal_unit_times(depth, args.unit_ms)
    variants = dict(emulated_depth.our_variants(depth))
    labels = [label for label in variants
              if args.only is None or any(word in label for word in args.only)]
    torch.set_num_threads(1)
    if args.timer_slack_ns is not None:
        _emulated_stages.set_timer_slack(args.timer_slack_ns)
    load = os.getloadavg()[0]
    sampler = _thread_cpu.ThreadCpuSampler().start() if args.thread_cpu else None
    per_rank = run_distributed(_rank, depth, labels, times,
                               emulated_depth.module_sizes(args.param_floats,
                                                           args.activation_floats),
                               count, args.iterations, timeout=3600)
    samples = sampler.stop() if sampler is not None else []
    print(f"D = {depth}, N = {count}, F = I = W = {args.unit_ms:g} ms per stage; load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after")
    for label in labels:
        plan, costs = emulated_depth.our_plan(variants[label], depth, count, times)
        simulated = simulate_plan(plan, stage_costs=costs)
        analyses = [analyse([per_rank[r][label][i] for r in range(depth)], simulated,
                            args.waited_ms / 1e3) for i in range(args.iterations)]
        print(report(label, analyses, args.verbose))
        if sampler is not None:
            rows = [per_rank[r][label][-1] for r in range(depth)]
            print("\n".join(_thread_cpu.window_table(
                samples, min(row["start"] for row in rows), max(row["end"] for row in rows),
                args.thread_cpu, op_overruns(rows, simulated))))
    return 0


def op_overruns(rows: list, simulated) -> list:
    """(end time, overrun seconds, kind letter) of every compute op of one iteration (``rows``:
    every rank's row, see _rank): measured duration minus the simulation's."""
    result = []
    for rank, row in enumerate(rows):
        charged = {str(e.op): e.end - e.start for e in simulated.timelines[rank]
                   if _is_compute(str(e.op))}
        for name, start, end in row["records"]:
            if _is_compute(name):
                result.append((row["origin"] + end, end - start - charged[name], name[0]))
    return result


if __name__ == "__main__":
    sys.exit(main())
