#!/usr/bin/env python
"""What one pipeline hop costs: a message passed round a ring of gloo ranks, raw and through ours.

    python benchmarks/p2p_hop.py                      # 2 ranks, 64 KB, 300 laps x 2 runs
    python benchmarks/p2p_hop.py --world 4 --floats 16384 --laps 200

A token goes round the ring (rank r sends to r + 1, receives from r − 1; rank 0 starts) and every
lap is timed on rank 0, as wall time and as rank 0's main-thread CPU time (``time.thread_time``).
The wall time is the hop latency (gloo, the operating system's wake-ups, the load of the machine);
the CPU time is what posting and completing the messages costs the rank itself, and is much less
sensitive to the machine's load. Modes, interleaved in each run:

* ``raw``: ``dist.isend`` / ``dist.irecv`` and ``wait`` (the floor);
* ``batch``: the same through ``dist.batch_isend_irecv`` (how a group of several messages is posted);
* ``tensor`` / ``packed``: our :class:`TensorTransport` / :class:`PackedTransport` (header + one
  contiguous buffer per peer), as the interpreter calls them (``start`` then ``wait_sent`` /
  ``wait_received``).

Printed per mode: median lap (p10–p90) and median main-thread CPU per lap. docs/benchmarks.md §9
("Where a hop's time goes") has the numbers of the transport before and after its per-message work
was cut.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.path.dirname(
        os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MODES = ("raw", "batch", "tensor", "packed")


def _hops(rank: int, world: int, floats: int):
    """{mode: hop(send: bool)} for this rank of the ring."""
    import torch.distributed as dist
    from _harness import parallel_state_for
    from megatron.core.pipeline_parallel.execution.packing import select_packer
    from megatron.core.pipeline_parallel.execution.transport import (ExpectedTensor,
                                                                    OutgoingTensor,
                                                                    PackedTransport,
                                                                    TensorTransport)
    argv = (f"--num-layers {world} --hidden-size 32 --num-attention-heads 4 --seq-length 8 "
            f"--max-position-embeddings 8 --vocab-size 64 --lr 1e-3 --train-iters 1 "
            f"--mock-data --micro-batch-size 1 --global-batch-size {world} "
            f"--pipeline-model-parallel-size {world}").split()
    state = parallel_state_for(rank, world, [argv])
    group, device = state.pipeline_group, torch.device("cpu")
    after, before = (rank + 1) % world, (rank - 1) % world
    payload = torch.ones(floats)

    def raw(send: bool) -> None:
        if send:
            work = dist.isend(payload, dist.get_global_rank(group, after), group=group)
        else:
            work = dist.irecv(torch.empty(floats), dist.get_global_rank(group, before),
                              group=group)
        assert work is not None  # this rank is in the group
        work.wait()

    def batch(send: bool) -> None:
        op = (dist.P2POp(dist.isend, payload, dist.get_global_rank(group, after), group=group)
              if send else dist.P2POp(dist.irecv, torch.empty(floats),
                                      dist.get_global_rank(group, before), group=group))
        for request in dist.batch_isend_irecv([op]):
            request.wait()

    def through(transport):
        def hop(send: bool) -> None:
            if send:
                transport.start([OutgoingTensor(after, payload, "token")], []).wait_sent()
            else:
                transport.start([], [ExpectedTensor(before, (floats,), torch.float32,
                                                    "token")]).wait_received()
        return hop

    return {"raw": raw, "batch": batch, "tensor": through(TensorTransport(state, device)),
            "packed": through(PackedTransport(state, device, packer=select_packer("auto")))}


def _measure_rank(rank: int, world: int, modes: list, laps: int, floats: int) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    hops = _hops(rank, world, floats)
    measured: dict = {mode: [] for mode in modes}
    for mode in modes:
        hop = hops[mode]
        dist.barrier()
        for _ in range(laps):
            wall, cpu = time.perf_counter(), time.thread_time()
            if rank == 0:
                hop(True)
                hop(False)
            else:
                hop(False)
                hop(True)
            measured[mode].append((time.perf_counter() - wall, time.thread_time() - cpu))
    return measured


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks in the ring (default 2)")
    parser.add_argument("--floats", type=int, default=1 << 14,
                        help="floats per message (default 16384: 64 KB, emulated_depth's)")
    parser.add_argument("--laps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=2, help="process groups, one after another")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    if args.world < 2 or args.laps < 20 or args.runs < 1 or args.floats < 1:
        parser.error("--world must be >= 2, --laps >= 20, --runs >= 1 and --floats >= 1")
    return args


def measure(world: int, modes: list, laps: int, floats: int, runs: int,
            timeout: float = 600.0) -> dict:
    """{mode: [(wall seconds, rank 0 main-thread CPU seconds) per lap]}, the first 10 laps of
    each run (connection warm-up) left out; a run past ``timeout`` seconds fails."""
    from dist_harness import run_distributed
    torch.set_num_threads(1)
    measured: dict = {mode: [] for mode in modes}
    for _ in range(runs):
        per_rank = run_distributed(_measure_rank, world, list(modes), laps, floats,
                                   timeout=timeout)
        for mode in modes:
            measured[mode] += per_rank[0][mode][10:]
    return measured


def main(argv=None) -> int:
    args = parse_args(argv)
    laps = measure(args.world, args.modes, args.laps, args.floats, args.runs)
    print(f"{args.world} ranks, {args.floats * 4} B per message, {len(laps[args.modes[0]])} laps "
          f"per mode; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for mode in args.modes:
        walls = sorted(wall for wall, _ in laps[mode])
        cpu = statistics.median(c for _, c in laps[mode])
        n = len(walls)
        print(f"{mode:7s} lap {statistics.median(walls) * 1e3:7.3f} ms "
              f"(p10 {walls[n // 10] * 1e3:.3f} – p90 {walls[9 * n // 10] * 1e3:.3f}); "
              f"rank 0 main-thread CPU per lap {cpu * 1e6:5.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
