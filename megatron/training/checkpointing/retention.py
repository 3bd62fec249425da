"""``--save-retain-interval``: which saved checkpoints stay on disk (Megatron's semantics).

After each successful save, the checkpoints under ``--save`` whose iteration is not a multiple of
the retain interval are deleted, except the one just saved (the tracker's): a long run keeps
every ``--save-retain-interval``-th checkpoint plus the latest, instead of every
``--save-interval``-th one.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable

_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


def checkpoints_to_delete(names: list[str], latest: int, retain_interval: int) -> list[str]:
    """The iteration directories among ``names`` that the retain interval does not keep."""
    doomed = []
    for name in names:
        match = _ITERATION_DIR.match(name)
        if match is None:
            continue
        iteration = int(match.group(1))
        if iteration != latest and iteration % retain_interval:
            doomed.append(name)
    return sorted(doomed)


def prune_checkpoints(root: str, latest: int, retain_interval: int,
                      log: Callable[[str], None]) -> list[str]:
    """Delete the checkpoints under ``root`` that are neither the latest nor retained; call on
    one rank after the save is published. Returns the deleted directory names."""
    doomed = checkpoints_to_delete(os.listdir(root), latest, retain_interval)
    for name in doomed:
        shutil.rmtree(os.path.join(root, name))
    if doomed:
        log(f"  deleted {len(doomed)} checkpoint(s) not kept by --save-retain-interval "
            f"{retain_interval}: {', '.join(doomed)}")
    return doomed
