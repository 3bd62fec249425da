"""Shared pytest set-up: one torch thread in the test process (so forked gloo ranks never hang),
tier markers assigned by directory, and a guard that keeps the fast tier free of processes.

Tiers: tests/distributed -> ``distributed`` (starts processes: gloo ranks, tools, scripts),
tests/smoke -> ``smoke`` (launches pretrain_gpt.py with torchrun), tests/unit/test_lint.py ->
``lint`` (runs ruff, and mypy in-process). Everything else (tests/unit, tests/numerics) is the
fast tier, ``-m "not distributed and not smoke"``: a test there that starts a process fails and is
told to move to tests/distributed.
"""

import multiprocessing.process
import os
import subprocess
import sys

import pytest
import torch

torch.set_num_threads(1)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.dirname(TESTS_DIR))

DIRECTORY_MARKERS = {"distributed": "distributed", "smoke": "smoke"}
FILE_MARKERS = {os.path.join("unit", "test_lint.py"): "lint"}
PROCESS_MARKERS = ("distributed", "smoke", "lint")


def pytest_collection_modifyitems(config, items):
    """Mark every test by its directory (and the lint file by name)."""
    for item in items:
        relative = os.path.relpath(str(item.path), TESTS_DIR)
        marker = FILE_MARKERS.get(relative) or DIRECTORY_MARKERS.get(relative.split(os.sep)[0])
        if marker is not None:
            item.add_marker(marker)


def _refuse_process(what: str, test: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(
            f"{test} starts a process ({what}), but it is in the fast tier (tests/unit, "
            f"tests/numerics); move its file to tests/distributed (or mark the test "
            f"@pytest.mark.distributed) so `-m \"not distributed and not smoke\"` stays fast")
    return refuse


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_processes(request, monkeypatch):
    """In the fast tier, starting a subprocess, a multiprocessing child or a fork raises."""
    if any(request.node.get_closest_marker(name) for name in PROCESS_MARKERS):
        yield
        return
    test = request.node.nodeid
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse_process("subprocess", test))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start",
                        _refuse_process("multiprocessing", test))
    monkeypatch.setattr(os, "fork", _refuse_process("os.fork", test))
    if hasattr(os, "posix_spawn"):
        monkeypatch.setattr(os, "posix_spawn", _refuse_process("os.posix_spawn", test))
    yield
