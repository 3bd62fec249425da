"""What makes a job restartable by its launcher (``torchrun --max-restarts``, SLURM requeue).

:func:`attempt_store` — torchrun's agent keeps one TCP store for the whole job (torch 2.13 shares
the rendezvous store with the workers, ``TORCHELASTIC_USE_AGENT_STORE=True``), so the keys the
first attempt's process groups left there (each rank's gloo address, barrier counters) are still
there when the restarted workers create theirs: a restarted rank could read a dead peer's address
and fail with ``Gloo connectFullMesh failed ... Connection refused``. Every attempt therefore works
under its own prefix (``TORCHELASTIC_RESTART_COUNT``) of that store.

:class:`StopWatchdog` — Python runs a signal handler only when the main thread returns to the
interpreter, so a rank blocked in C++ (creating a process group whose peer died, a collective)
ignored torchrun's SIGTERM until the SIGKILL 30 s later. The watchdog's thread learns of the
signal through :func:`signal.set_wakeup_fd` at once and ends the process after a grace period in
which the normal handler may still unwind.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
from typing import Mapping, Optional

import torch.distributed as dist

ATTEMPT_PREFIX = "/megatron/attempt_"


def restart_attempt(env: Mapping[str, str]) -> int:
    """torchrun's restart count of this worker (0 on the first attempt or without torchrun)."""
    value = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def attempt_store(env: Mapping[str, str], rank: int, world_size: int,
                  timeout: datetime.timedelta, *, master_addr: str, master_port: int):
    """The rendezvous store of this attempt: torchrun's store (the agent's, or rank 0's when the
    agent does not share one) under the prefix of the restart count.

    ``master_addr`` / ``master_port`` come from
    :func:`~megatron.training.launch_env.read_launch_environment`, which defaults them
    (127.0.0.1:29500) when a launcher that sets RANK and WORLD_SIZE (``torch.distributed.launch``,
    a site's own wrapper) leaves them unset; reading ``env`` directly raised a bare KeyError."""
    uses_agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(master_addr, master_port, world_size,
                          is_master=not uses_agent_store and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"{ATTEMPT_PREFIX}{restart_attempt(env)}", store)


class StopWatchdog:
    """End the process ``grace_seconds`` after SIGTERM/SIGINT if it is still alive then.

    Installed by the script's main thread (``signal.set_wakeup_fd`` must be); the existing
    Python handlers keep working and get the grace period to unwind. Exit status 128 + signal."""

    def __init__(self, grace_seconds: float = 5.0):
        self.grace_seconds = grace_seconds
        self._receiver: Optional[socket.socket] = None
        self._sender: Optional[socket.socket] = None
        self._previous_fd = -1

    def install(self) -> "StopWatchdog":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals are delivered to the main thread only
        self._receiver, self._sender = socket.socketpair()
        self._sender.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._sender.fileno(),
                                                 warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()
        return self

    def uninstall(self) -> None:
        if self._sender is not None:
            signal.set_wakeup_fd(self._previous_fd)

    def _watch(self) -> None:
        while True:
            try:
                data = self._receiver.recv(64)
            except OSError:
                return
            if not data:
                return
            stops = [number for number in data if number in (signal.SIGTERM, signal.SIGINT)]
            if stops:
                timer = threading.Timer(self.grace_seconds, self._stop, args=(stops[0],))
                timer.daemon = True
                timer.start()

    def _stop(self, signum: int) -> None:
        try:
            sys.stderr.write(f"pretrain_gpt.py: still running {self.grace_seconds:.0f} s after "
                             f"signal {signal.Signals(signum).name} (blocked in a collective or "
                             f"in process-group creation); stopping now\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(128 + signum)
