"""One builder at a time: the inter-process lock around the packing extension's JIT compilation.

When several processes (the ranks of a job, on one node or on nodes sharing a home directory) need
the C++ extension compiled at first use, exactly one must compile while the others wait, and a lock
left by a process that died must be reported rather than waited on forever.

torch.utils.cpp_extension has a lock of its own (``FileBaton``, a ``lock`` file created with
``O_CREAT | O_EXCL`` in the extension's build directory): the process that creates it builds, the
others poll every 0.1 s until the file disappears, with no timeout and no owner recorded. A build
killed mid-way (SIGKILL, out of memory, a preempted job) leaves the file behind, and every later
process then hangs silently in ``cpp_extension.load``.

:func:`run_exclusively` makes the same idea explicit and bounded. The lock is a file created with
``O_CREAT | O_EXCL`` (atomic, also on NFS v3+ and Lustre) holding its owner's pid, host, pid
namespace (containers on one host may share a host name, not their pids) and start time. A
process that finds it held waits, polling, and raises a RuntimeError naming the lock file:

- at once when the lock is stale: its owner's pid no longer runs on this host (same host name and
  pid namespace), or the lock is older than ``stale_after_s`` (the only test possible for an owner
  on another host or in another container);
- after ``timeout_s`` when a live owner has not finished.

Stale locks are never deleted automatically (two waiters could both delete and both build); the
message says which file to delete. The build runs under the lock in every process in turn, so with
a cached build (torch's ninja build is incremental) the first process compiles and the others only
load. Nothing here imports torch, so the logic is testable with a fake build function.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

Result = TypeVar("Result")

DEFAULT_TIMEOUT_S = 600.0       # waiting for a live builder (a first compilation takes 12-110 s)
DEFAULT_STALE_AFTER_S = 1800.0  # a lock older than this is stale even if its owner is unknown
DEFAULT_POLL_S = 0.2


@dataclass(frozen=True)
class LockOwner:
    """Who holds a build lock, as recorded in the lock file."""

    pid: int
    host: str
    started: float  # time.time() when the lock was taken
    pid_namespace: str = ""  # "" where unknown

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


def _this_host() -> str:
    return socket.gethostname()


def _this_pid_namespace() -> str:
    """The pid namespace of this process (Linux), so that a pid is only judged where it means
    the same process; "" elsewhere."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def read_lock_owner(lock_path: Path) -> Optional[LockOwner]:
    """The owner recorded in ``lock_path``; None when the file is gone or not yet written."""
    try:
        text = Path(lock_path).read_text()
        record = json.loads(text)
        return LockOwner(int(record["pid"]), str(record["host"]), float(record["started"]),
                         str(record.get("pid_namespace", "")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # being written right now (or not ours): judged by the file's age instead


def process_is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def stale_lock_reason(lock_path: Path, owner: Optional[LockOwner], now: float,
                      stale_after_s: float, host: Optional[str] = None) -> Optional[str]:
    """Why the lock at ``lock_path`` is stale, or None while its owner may still be building."""
    host = _this_host() if host is None else host
    same_process_table = (owner is not None and owner.host == host
                          and owner.pid_namespace == _this_pid_namespace())
    if same_process_table and owner is not None and not process_is_running(owner.pid):
        return f"its owner, {owner.describe()}, is no longer running"
    if owner is not None:
        started = owner.started
    else:
        try:
            started = os.stat(lock_path).st_mtime
        except FileNotFoundError:
            return None
    age = now - started
    if age > stale_after_s:
        holder = owner.describe() if owner is not None else "an unknown process"
        return (f"it was taken by {holder} {age:.0f} s ago, longer than the {stale_after_s:.0f} s "
                f"a build may take")
    return None


def _try_acquire(lock_path: Path) -> bool:
    """Create the lock file atomically with this process as owner; False if it exists."""
    try:
        descriptor = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    record = {"pid": os.getpid(), "host": _this_host(), "started": time.time(),
              "pid_namespace": _this_pid_namespace()}
    with os.fdopen(descriptor, "w") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _release(lock_path: Path) -> None:
    try:
        os.remove(lock_path)
    except FileNotFoundError:
        pass


def run_exclusively(lock_path, build: Callable[[], Result], *, what: str = "the build",
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    stale_after_s: float = DEFAULT_STALE_AFTER_S,
                    poll_s: float = DEFAULT_POLL_S,
                    log: Optional[Callable[[str], None]] = None) -> Result:
    """Run ``build()`` while holding the file lock ``lock_path``; return its result.

    Waits while another live process holds the lock. Raises RuntimeError naming the lock file (and
    saying to delete it) when the lock is stale, and after ``timeout_s`` of waiting on a live owner.
    The lock is released when ``build`` returns or raises.
    """
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    waited_since = time.monotonic()
    announced = False
    while not _try_acquire(lock_path):
        owner = read_lock_owner(lock_path)
        reason = stale_lock_reason(lock_path, owner, time.time(), stale_after_s)
        if reason is not None:
            raise RuntimeError(
                f"{what} is locked by {lock_path}, which is stale: {reason}. A build was "
                f"interrupted; delete the lock file (rm {lock_path}) and start again")
        waited = time.monotonic() - waited_since
        holder = owner.describe() if owner is not None else "another process"
        if waited > timeout_s:
            raise RuntimeError(
                f"waited {waited:.0f} s for {holder} to finish {what} (lock file {lock_path}); "
                f"if that process is stuck, stop it and delete the lock file (rm {lock_path})")
        if log is not None and not announced:
            log(f"waiting for {holder} to finish {what} (lock file {lock_path})")
            announced = True
        time.sleep(poll_s)
    try:
        return build()
    finally:
        _release(lock_path)
