"""A rank told to stop (SIGTERM) while it waits in C++ — here creating a process group whose peer
never arrives — stops within seconds with status 143 (``restarts.StopWatchdog``), instead of
ignoring the signal until the launcher's SIGKILL (Python runs handlers only between bytecodes)."""

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCKED_RANK = """
import datetime, signal, sys, torch.distributed as dist
from megatron.training.restarts import StopWatchdog
def stop(signum, frame):
    raise SystemExit(128 + signum)
signal.signal(signal.SIGTERM, stop)
if sys.argv[2] == "watchdog":
    StopWatchdog(grace_seconds=2).install()
store = dist.FileStore(sys.argv[1], 2)
print("waiting", flush=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=2,   # rank 1 never comes
                        timeout=datetime.timedelta(seconds=60))
"""


def _stop_after_sigterm(tmp_path, mode: str) -> tuple[int, float]:
    process = subprocess.Popen([sys.executable, "-c", BLOCKED_RANK, str(tmp_path / "store"), mode],
                               cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout.readline().strip() == "waiting"
        time.sleep(1.0)  # inside init_process_group's C++ wait by now
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            process.wait(timeout=12)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - sent
        return process.returncode, time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_rank_blocked_in_group_creation_stops_within_seconds(tmp_path):
    returncode, seconds = _stop_after_sigterm(tmp_path, "watchdog")
    assert returncode == 128 + signal.SIGTERM and seconds < 10, (returncode, seconds)


def test_without_the_watchdog_the_signal_waits_for_the_cpp_call(tmp_path):
    """The reason for the watchdog (so the test above can fail): the plain handler does not run
    while the main thread is blocked in C++."""
    returncode, seconds = _stop_after_sigterm(tmp_path, "plain")
    assert returncode is None or seconds > 10, (returncode, seconds)
