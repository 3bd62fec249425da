"""megatron.training.process_tree: a process's direct children from /proc."""

import os
import subprocess
import sys

import pytest

from megatron.training.process_tree import child_pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_children_are_listed_and_grandchildren_are_not():
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
              "print(child.pid, flush=True); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        assert parent.pid in child_pids(os.getpid())
        assert child_pids(parent.pid) == [grandchild]
        assert grandchild not in child_pids(os.getpid())
    finally:
        subprocess.run(["kill", str(grandchild)], check=False)
        parent.kill()
        parent.wait(timeout=10)
