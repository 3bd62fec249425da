"""The direct children of a process, read from Linux's ``/proc`` (the workers of a torchrun agent,
the ranks of a benchmark): used by the stress tool, the thread-CPU sampler and the restart tests."""

from __future__ import annotations

import os


def child_pids(parent: int) -> list[int]:
    """Process ids whose parent is ``parent``, ascending (start order, short of pid wrap-around);
    processes that end while being read are skipped. Empty where there is no ``/proc``."""
    if not os.path.isdir("/proc"):
        return []
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        except OSError:
            continue
        if int(fields[1]) == parent:  # fields[1]: the parent pid
            children.append(int(entry))
    return sorted(children)
