"""Which threads of the benchmark's ranks use the cores, and how long the ranks' main threads wait
for one, over an iteration (``emulated_lateness.py --thread-cpu``; Linux only).

A daemon thread of the parent process polls ``/proc/<pid>/task/<tid>/schedstat`` of every child
process (the ranks) every ``period`` seconds: per thread the CPU time it has run and the time it
has waited runnable in a run queue (the kernel's ``run_delay``), both in nanoseconds. Between two
polls a thread's deltas are charged to the window of the later poll. Threads are grouped by kind:
the rank's main thread (tid = pid: the interpreter, the modules, autograd), gloo's TCP loop threads
(``gloo_tcp_loop``: reading and writing the messages of every process group), the process groups'
collective workers (``pt_gloo_runloop``: the all-reduces), and the rest. Times are
CLOCK_MONOTONIC (``time.monotonic``), the clock ``time.perf_counter`` reads on Linux, so windows
line up with the ranks' op records.

Polling costs the parent ~1 ms of CPU per poll at D = 16 (about 200 threads): a 20 ms period
takes ~5% of one core.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

from megatron.training.process_tree import child_pids

MAIN = "main"
KINDS = (MAIN, "gloo_tcp_loop", "pt_gloo_runloop")
OTHER = "other"


class ThreadCpuSampler:
    """Samples (time, pid, tid, kind, cpu ns, run-queue ns) of the children of this process."""

    def __init__(self, period: float = 0.02, rescan: float = 1.0):
        self.period, self.rescan = period, rescan
        self.samples: list[tuple] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._kinds: dict[int, str] = {}

    def start(self) -> "ThreadCpuSampler":
        self._thread = threading.Thread(target=self._poll, name="thread-cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[tuple]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples

    def _kind(self, pid: int, tid: int) -> str:
        kind = self._kinds.get(tid)
        if kind is None:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as handle:
                    name = handle.read().strip()
            except OSError:
                name = ""
            kind = MAIN if tid == pid else (name if name in KINDS else OTHER)
            self._kinds[tid] = kind
        return kind

    def _poll(self) -> None:
        parent, pids, scanned = os.getpid(), [], 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - scanned > self.rescan:
                pids, scanned = child_pids(parent), now
            for pid in pids:
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for name in tids:
                    tid = int(name)
                    try:
                        with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                            cpu, queued, _ = handle.read().split()
                    except OSError:
                        continue
                    self.samples.append((now, pid, tid, self._kind(pid, tid), int(cpu),
                                         int(queued)))
            self._stop.wait(self.period)


def window_table(samples: list[tuple], start: float, end: float, windows: int,
                 op_overruns: list[tuple]) -> list[str]:
    """Lines of a table over ``windows`` equal windows of [start, end]: per window the cores used
    by each thread kind (CPU seconds / window seconds, summed over ranks), the mean run-queue wait
    of a rank's main thread (ms per 100 ms), and the mean overrun of the compute ops ending in it
    (``op_overruns``: (end time, overrun seconds, op kind letter)), all ops and weight halves."""
    width = (end - start) / windows
    cpu = [[0.0] * windows for _ in (*KINDS, OTHER)]
    queued = [0.0] * windows
    index = {kind: k for k, kind in enumerate((*KINDS, OTHER))}
    last: dict[int, tuple] = {}
    main_threads = set()
    for now, _pid, tid, kind, cpu_ns, queued_ns in samples:
        previous = last.get(tid)
        last[tid] = (cpu_ns, queued_ns)
        if kind == MAIN:
            main_threads.add(tid)
        if previous is None or not start <= now < end:
            continue
        window = int((now - start) / width)
        cpu[index[kind]][window] += (cpu_ns - previous[0]) / 1e9
        if kind == MAIN:
            queued[window] += (queued_ns - previous[1]) / 1e9
    ranks = max(1, len(main_threads))
    lines = ["  threads (cores used per window, summed over ranks; main run-queue wait per rank; "
             "overrun of the ops ending in the window):",
             "      window ms " + " ".join(f"{kind[:15]:>15}" for kind in (*KINDS, OTHER))
             + "  main queued ms/100ms  overrun ms (all / W)"]
    for window in range(windows):
        low, high = start + window * width, start + (window + 1) * width
        ending = [(over, kind) for when, over, kind in op_overruns if low <= when < high]
        every = [over for over, _ in ending]
        weights = [over for over, kind in ending if kind == "W"]
        mean_all = f"{sum(every) / len(every) * 1e3:.2f}" if every else "-"
        mean_w = f"{sum(weights) / len(weights) * 1e3:.2f}" if weights else "-"
        span = f"{(low - start) * 1e3:.0f}-{(high - start) * 1e3:.0f}"
        lines.append(f"    {span:>11} "
                     + " ".join(f"{cpu[k][window] / width:15.2f}" for k in range(len(cpu)))
                     + f"  {queued[window] / width / ranks * 100:20.2f}  {mean_all:>6} / {mean_w}")
    return lines
