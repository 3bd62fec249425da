"""Checks made before the first iteration so that no fault loses work.

:func:`check_checkpoint_directories` refuses a run that would overwrite checkpoints it does not
resume from or whose ``--load`` tracker is unreadable or names a missing iteration, and proves that
``--save`` is writable, before any model is built or any iteration
run (a bad ``--save`` used to surface only at the first save, after the work before it was done).
Every rank may run it independently (it only reads the shared file system and writes a file named
after its own host and process), so it needs no process group.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Optional

from megatron.training.checkpointing.files import TRACKER_FILENAME, iteration_dir_name, read_tracker

ITERATION_DIR_PATTERN = re.compile(r"^iter_\d{7}$")
ALLOW_OVERWRITE_FLAG = "--allow-overwrite-checkpoints"


def saved_iterations(root: str) -> list[str]:
    """Names of the ``iter_NNNNNNN`` directories in ``root`` (empty when it does not exist)."""
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root)
                  if ITERATION_DIR_PATTERN.match(name) and os.path.isdir(os.path.join(root, name)))


def _readable_tracker(root: str) -> tuple[Optional[int], Optional[str]]:
    """(iteration, None) for a readable tracker, (None, reason) otherwise."""
    try:
        iteration = read_tracker(root)
    except (OSError, ValueError) as error:
        return None, str(error)
    if iteration is None:
        return None, f"there is no {TRACKER_FILENAME}"
    return iteration, None


def check_no_overwrite(checkpoint_config) -> None:
    """Raise ValueError when this run would start afresh over ``--save``'s checkpoints.

    Safe: ``--save`` holds no ``iter_*`` directory, or ``--load`` is the same directory with a
    readable tracker (an ordinary resume, without ``--finetune``). Anything else (tracker missing or
    unreadable, ``--load`` mistyped or elsewhere, no ``--load``) would replace or shadow saved
    iterations, so it stops unless ``--allow-overwrite-checkpoints`` is given.
    """
    save = checkpoint_config.save
    if not save or getattr(checkpoint_config, "allow_overwrite_checkpoints", False):
        return
    existing = saved_iterations(save)
    if not existing:
        return
    held = f"--save {save} already holds checkpoints ({', '.join(existing[-3:])})"
    iteration, reason = _readable_tracker(save)
    if reason is not None and iteration is None and os.path.exists(
            os.path.join(save, TRACKER_FILENAME)):
        raise ValueError(f"{held} but its {TRACKER_FILENAME} is unreadable ({reason}); fix the "
                         f"tracker to name the newest complete iteration, or pass "
                         f"{ALLOW_OVERWRITE_FLAG} to start from scratch and overwrite them")
    if iteration is None:
        raise ValueError(f"{held} but no {TRACKER_FILENAME}, so this run would start from scratch "
                         f"and overwrite them; write the newest complete iteration into "
                         f"{os.path.join(save, TRACKER_FILENAME)} and pass --load {save}, or pass "
                         f"{ALLOW_OVERWRITE_FLAG} to start from scratch")
    load = checkpoint_config.load
    if not load:
        raise ValueError(f"{held} (tracker: iteration {iteration}) and this run does not load "
                         f"them (no --load), so it would overwrite them; pass --load {save} to "
                         f"resume, another --save, or {ALLOW_OVERWRITE_FLAG}")
    if os.path.realpath(load) != os.path.realpath(save):
        load_iteration, load_reason = _readable_tracker(load)
        found = (f"resumes from iteration {load_iteration} of --load {load}"
                 if load_iteration is not None else
                 f"finds no checkpoint in --load {load} ({load_reason}; mistyped?)")
        raise ValueError(f"{held} (tracker: iteration {iteration}) but this run {found}, so it "
                         f"would overwrite or shadow them; pass --load {save} to resume, another "
                         f"--save, or {ALLOW_OVERWRITE_FLAG}")
    if checkpoint_config.finetune:
        raise ValueError(f"{held} and --finetune restarts at iteration 0 over them; pass another "
                         f"--save, or {ALLOW_OVERWRITE_FLAG}")


def check_load_tracker(load: Optional[str]) -> None:
    """Raise ValueError when ``--load``'s tracker cannot be resumed from: it is not an iteration
    number, or names an iteration whose directory is missing. Checked before any process group,
    so the run stops with one line instead of a traceback per rank after building the model. A
    missing directory or tracker is not an error here (the run starts from scratch, as in
    Megatron; :func:`check_no_overwrite` guards ``--save``)."""
    if not load or not os.path.isdir(load):
        return
    try:
        iteration = read_tracker(load)
    except (OSError, ValueError) as error:
        raise ValueError(f"--load {load}: {error}") from None
    if iteration is None or os.path.isdir(os.path.join(load, iteration_dir_name(iteration))):
        return
    present = saved_iterations(load)
    choice = (f"the directory holds {', '.join(present[-3:])}: write the newest complete one's "
              f"number into {os.path.join(load, TRACKER_FILENAME)}" if present else
              "the directory holds no iter_* directory: point --load at the directory the "
              "checkpoints were saved to")
    raise ValueError(f"--load {load}: {TRACKER_FILENAME} names iteration {iteration}, but "
                     f"{iteration_dir_name(iteration)} does not exist there; {choice}")


def check_save_writable(save: Optional[str]) -> None:
    """Create ``--save`` and write, then remove, a probe file; ValueError naming the path if not."""
    if not save:
        return
    probe = os.path.join(save, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        if os.path.exists(save) and not os.path.isdir(save):
            raise NotADirectoryError(f"{save} is a file")
        os.makedirs(save, exist_ok=True)
        with open(probe, "w") as handle:
            handle.write("probe\n")
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"--save {save} is not a writable directory ({type(error).__name__}: "
                         f"{error}); checkpoints could not be saved: pass a directory this job "
                         f"can write") from None


def check_checkpoint_directories(checkpoint_config) -> None:
    """The checks, in the order a user fixes them: a resumable --load, nothing overwritten, then
    writability."""
    check_load_tracker(checkpoint_config.load)
    check_no_overwrite(checkpoint_config)
    check_save_writable(checkpoint_config.save)
