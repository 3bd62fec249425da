"""The code base passes its linter and type checker (configured in pyproject.toml).

ruff (pyflakes, pycodestyle errors, bugbear) over the repository and mypy over megatron/core run
as subprocesses from the repository root, so CI (which runs the README's pytest command) runs them.
tests/conftest.py marks this file ``lint``: it is the only fast-tier file allowed to start processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run_tool(module: str, *arguments: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        raise AssertionError(f"{module} is not installed; install the test extra: "
                             f"pip install -e '.[test]' (setup.py pins its version)")
    return subprocess.run([sys.executable, "-m", module, *arguments], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing():
    result = _run_tool("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, (
        f"ruff check found problems (fix them, or see [tool.ruff] in pyproject.toml):\n"
        f"{result.stdout}{result.stderr}")


def test_mypy_finds_nothing_in_megatron_core():
    result = _run_tool("mypy")  # files and options: [tool.mypy] in pyproject.toml
    assert result.returncode == 0, (
        f"mypy found problems (fix them, or see [tool.mypy] in pyproject.toml):\n"
        f"{result.stdout}{result.stderr}")
