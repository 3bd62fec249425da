#!/usr/bin/env python
"""Where an emulated pipeline iteration loses time against its plan: per op, per hop, per rank.

    python benchmarks/emulated_overhead.py                       # D = 4, N = 8, 20 ms units
    python benchmarks/emulated_overhead.py --only "chimera split" --torch Schedule1F1B
    python benchmarks/emulated_overhead.py --unit-ms 80 --iterations 2

Runs configurations of benchmarks/emulated_depth.py (the same sleeping stages, real gloo messages,
real stage all-reduces) and, instead of one iteration time, splits every rank's iteration into what
the plan does not charge:

* per compute op of our runtime (timed through the interpreter's handler seam,
  ``PipelineRuntime.extra_op_handlers``): main-thread CPU (``time.thread_time``: our Python, the
  autograd engine, posting messages, the emulated module's own work; on a virtual machine it also
  counts time the host took the virtual CPU away), run delay (waiting for a core while runnable,
  from ``/proc/thread-self/schedstat``) and sleep overshoot (the emulated op slept longer than asked);
* per P2P group (posting sends and receives): CPU and run delay;
* per iteration and rank: wall, CPU, run delay, the sum of sleep overshoots, and the time spent
  waiting for the stage all-reduce after the list (Chimera's replicas; 0 without replicas);
* per message, from one more iteration recorded with the interpreter's timeline: for the hops a
  consumer waited for (> 1 ms), send post -> input ready beyond the later of post and ask (the
  hop's own latency: gloo, the wake-ups of the receiver's loop and main threads, unpacking), and
  how long posting a send took.

PyTorch schedules (``--torch NAME ...``) get the per-iteration columns only (wall, CPU, run delay,
sleep overshoot: the same module sleeps on both sides). The emulated module's sleeps are recorded by
replacing ``_emulated_stages.time`` in the worker processes with a recording clock.
docs/benchmarks.md §9 ("Per-op and per-hop overhead at 20 ms units") has a run and what it showed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from types import MappingProxyType

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.path.dirname(os.path.abspath(
        __file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import _emulated_stages  # noqa: E402
import emulated_depth  # noqa: E402
from _harness import format_table, oversubscription_note  # noqa: E402

WAITED_SECONDS = 1e-3  # a consumer that waited longer than this for its input really waited


class RecordingClock:
    """Stands in for the ``time`` module inside ``_emulated_stages``: sleeps, and records every
    (asked, slept) pair."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self):
        self.sleeps: list = []

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.sleeps.append((seconds, time.perf_counter() - start))


class ThreadClock:
    """This thread's CPU seconds and run delay (seconds runnable but waiting for a core)."""

    def __init__(self):
        self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY) \
            if os.path.exists("/proc/thread-self/schedstat") else None

    def read(self) -> tuple[float, float]:
        if self._schedstat is None:  # not Linux: CPU only
            return time.thread_time(), 0.0
        cpu_ns, delay_ns = os.pread(self._schedstat, 128, 0).split()[:2]
        return int(cpu_ns) / 1e9, int(delay_ns) / 1e9


def _op_name(kind) -> str:
    return getattr(kind, "name", getattr(kind, "__name__", str(kind)))


def _timed_handlers(clock: ThreadClock, sleeps: RecordingClock, samples: list) -> dict:
    """The interpreter's handlers, each wrapped to append (op kind, CPU, run delay, sleep
    overshoot) per op to ``samples``."""
    from megatron.core.pipeline_parallel.execution.interpreter import DEFAULT_OP_HANDLERS

    def wrap(name, run):
        def timed(interpreter, op):
            first_sleep = len(sleeps.sleeps)
            cpu, delay = clock.read()
            run(interpreter, op)
            cpu_after, delay_after = clock.read()
            overshoot = sum(slept - asked for asked, slept in sleeps.sleeps[first_sleep:])
            samples.append((name, cpu_after - cpu, delay_after - delay, overshoot))
        return timed

    return MappingProxyType({kind: dataclasses.replace(handler, run=wrap(_op_name(kind),
                                                                         handler.run))
                             for kind, handler in DEFAULT_OP_HANDLERS.items()})


def _iteration(step, clock: ThreadClock, sleeps: RecordingClock, reducer_wait: list) -> dict:
    import torch.distributed as dist
    dist.barrier()
    sleeps.sleeps.clear()
    reducer_wait[:] = [0.0]
    wall, (cpu, delay) = time.perf_counter(), clock.read()
    step()
    cpu_after, delay_after = clock.read()
    wall_after = time.perf_counter()
    dist.barrier()
    return {"wall": wall_after - wall, "cpu": cpu_after - cpu, "run_delay": delay_after - delay,
            "overshoot": sum(slept - asked for asked, slept in sleeps.sleeps),
            "sleeps": len(sleeps.sleeps), "reducer_wait": reducer_wait[0]}


def _rank(rank, world_size, labels, torch_names, times, sizes, count, iterations):
    import logging

    from _harness import parallel_state_for

    from megatron.core.distributed import gradient_reducer
    from megatron.core.runtimes.pipeline import PipelineRuntime
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    sleeps, clock = RecordingClock(), ThreadClock()
    _emulated_stages.time = sleeps  # this worker process only
    samples: list = []
    handlers = _timed_handlers(clock, sleeps, samples)
    reducer_wait = [0.0]
    plain_wait = gradient_reducer.GradientReducer.wait

    def timed_wait(reducer):
        start = time.perf_counter()
        plain_wait(reducer)
        reducer_wait[0] += time.perf_counter() - start
    gradient_reducer.GradientReducer.wait = timed_wait  # this worker process only
    PipelineRuntime.extra_op_handlers = handlers
    variants = dict(emulated_depth.our_variants(world_size))
    state = parallel_state_for(rank, world_size, [emulated_depth._config_flags(world_size, count)
                                                  + flags for flags in variants.values()])
    results = {}
    for label in labels:
        _, step, _ = emulated_depth._our_configuration(label, variants[label], state, world_size,
                                                       count, times, sizes,
                                                       emulated_depth.FREE)
        _iteration(step, clock, sleeps, reducer_wait)  # warm-up
        samples.clear()
        rows = [_iteration(step, clock, sleeps, reducer_wait) for _ in range(iterations)]
        ops = list(samples)
        hops = step(record=True)
        results[label] = {"iterations": rows, "ops": ops,
                          "hops": [(hop.posted, hop.post_returned, hop.asked, hop.ready)
                                   for hop in hops]}
    for name in torch_names:
        label, step, _ = emulated_depth._torch_configuration(name, rank, world_size, count, times,
                                                             sizes)
        _iteration(step, clock, sleeps, reducer_wait)
        results[label] = {"iterations": [_iteration(step, clock, sleeps, reducer_wait)
                                         for _ in range(iterations)]}
    return results


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def report(per_rank: list, iterations: int, plans: dict) -> str:
    lines = []
    for label, result in per_rank[0].items():
        walls = [max(rank[label]["iterations"][i]["wall"] for rank in per_rank)
                 for i in range(iterations)]
        measured = statistics.median(walls)
        planned = plans.get(label)
        ratio = f"; measured / simulated {planned / measured:.3f}" if planned else ""
        lines.append(f"== {label}: iteration {_ms(measured)} ms (min {_ms(min(walls))}, max "
                     f"{_ms(max(walls))}){ratio}")
        rows = []
        for index, rank in enumerate(per_rank):
            its = rank[label]["iterations"]
            rows.append([index] + [_ms(statistics.median(it[key] for it in its))
                                   for key in ("wall", "cpu", "run_delay", "overshoot",
                                               "reducer_wait")]
                        + [f"{statistics.median(it['sleeps'] for it in its):g}"])
        lines.append(format_table(["rank", "wall ms", "CPU ms", "run delay ms",
                                   "sleep overshoot ms", "all-reduce wait ms", "sleeps"], rows))
        if "ops" not in result:
            lines.append("")
            continue
        kinds = sorted({sample[0] for rank in per_rank for sample in rank[label]["ops"]})
        rows = []
        for kind in kinds:
            picked = [s for rank in per_rank for s in rank[label]["ops"] if s[0] == kind]
            rows.append([kind, f"{len(picked) / iterations / len(per_rank):.1f}"]
                        + [f"{statistics.mean(s[i] for s in picked) * 1e3:.3f}"
                           for i in (1, 2, 3)])
        lines.append(format_table(["op kind", "per rank", "CPU ms", "run delay ms",
                                   "sleep overshoot ms"], rows))
        hops = result["hops"]
        waited = sorted(ready - max(posted, asked) for posted, _, asked, ready in hops
                        if ready - asked > WAITED_SECONDS)
        posting = sorted(returned - posted for posted, returned, _, _ in hops)
        if waited:
            lines.append(f"hops: {len(hops)}, {len(waited)} waited for; their latency beyond the "
                         f"later of send post and ask: median {_ms(statistics.median(waited))} "
                         f"ms, p10 {_ms(waited[len(waited) // 10])}, p90 "
                         f"{_ms(waited[9 * len(waited) // 10])}; posting a send: median "
                         f"{_ms(statistics.median(posting))} ms, max {_ms(posting[-1])}")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--count", type=int, default=2, help="N as a multiple of D (default 2)")
    parser.add_argument("--unit-ms", type=float, default=20.0,
                        help="F = I = W per stage, milliseconds (default 20)")
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations each")
    parser.add_argument("--only", nargs="*", default=None,
                        help="our configurations whose label contains one of these words "
                             "(default: 1f1b, 1f1b split, interleaved-1f1b, chimera, chimera "
                             "split, chimera interleaved split)")
    parser.add_argument("--torch", nargs="*", default=["Schedule1F1B"],
                        choices=emulated_depth.TORCH_SCHEDULES,
                        help="PyTorch schedules to run for comparison (per-iteration columns)")
    parser.add_argument("--param-floats", type=int, default=1 << 20,
                        help="parameter floats per stage of 1/D of the model (as in "
                             "emulated_depth.py)")
    parser.add_argument("--activation-floats", type=int, default=1 << 14)
    parser.add_argument("--timer-slack-ns", type=int, default=None,
                        help="Linux timer slack of every rank, set before they start "
                             "(see emulated_depth.py); default: leave it")
    args = parser.parse_args(argv)
    if args.depth < 2 or args.depth % 2 or args.count < 1 or args.iterations < 1:
        parser.error("--depth must be even >= 2, --count and --iterations >= 1")
    return args


def main(argv=None) -> int:
    from dist_harness import run_distributed
    args = parse_args(argv)
    depth, count = args.depth, args.count * args.depth
    times = emulated_depth.equal_unit_times(depth, args.unit_ms)
    labels = [label for label, _ in emulated_depth.our_variants(depth)
              if (args.only is None and "4-pipe" not in label)
              or (args.only is not None and any(word in label for word in args.only))]
    plans = {label: emulated_depth.simulate_ours(flags, depth, count, times)[0]
             for label, flags in emulated_depth.our_variants(depth) if label in labels}
    for name in args.torch:
        plans[f"torch {name}"] = emulated_depth.simulate_torch(name, depth, count, times)[0]
    torch.set_num_threads(1)
    if args.timer_slack_ns is not None:
        _emulated_stages.set_timer_slack(args.timer_slack_ns)
    load = os.getloadavg()[0]
    per_rank = run_distributed(_rank, depth, labels, args.torch, times,
                               emulated_depth.module_sizes(args.param_floats,
                                                           args.activation_floats),
                               count, args.iterations, timeout=3600)
    print(f"D = {depth}, N = {count}, F = I = W = {args.unit_ms:g} ms per stage; load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after; medians over {args.iterations} "
          f"iteration(s) per rank; op rows: means over ranks and iterations")
    print(report(per_rank, args.iterations, plans))
    print(oversubscription_note(depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
