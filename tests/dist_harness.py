"""Run a function on several gloo ranks from a test, with timeouts and readable failures.

``run_distributed(fn, world_size, *args)`` forks ``world_size`` processes, each with one torch thread
(a forked child hangs if the parent ran multi-threaded torch ops first, and 2 cores are shared), joins
them in a gloo process group through a file store, calls ``fn(rank, world_size, *args)`` and returns
the list of per-rank return values. Any exception in any rank, or a rank that does not finish within
``timeout`` seconds, fails the call with every rank's traceback; stuck ranks are killed, never waited on.
Return values travel through a pipe as pickle bytes, so they must be picklable (tensors are fine).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback


def _child(fn, rank, world_size, store_path, collective_timeout, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        value = fn(rank, world_size, *args)
        # Plain pickle bytes: a queue would send tensors through shared memory that dies with
        # this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(value)))
        dist.destroy_process_group()
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; return their results."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        processes = [context.Process(target=_child, daemon=True,
                                     args=(fn, rank, world_size, store_path, max(timeout / 2, 5),
                                           args, results))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        outcomes = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcomes[rank] = (status, value)
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [r for r, p in enumerate(processes)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in outcomes]
                for rank in dead:
                    outcomes[rank] = ("error", f"rank {rank} died with exit code "
                                               f"{processes[rank].exitcode}")
        for process in processes:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()
    failures = {r: v for r, (s, v) in outcomes.items() if s != "ok"}
    missing = sorted(set(range(world_size)) - set(outcomes))
    if failures or missing:
        lines = [f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) failed"]
        if missing:
            lines.append(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---\n{failures[rank]}")
        raise AssertionError("\n".join(lines))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
