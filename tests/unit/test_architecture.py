"""The architecture's promises that a reader cannot check at a glance (docs/architecture.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_planning_package_and_performance_model_import_no_torch():
    code = ("import importlib, pkgutil, sys\n"
            "import megatron.core.pipeline_parallel.planning as planning\n"
            "for module in pkgutil.walk_packages(planning.__path__, planning.__name__ + '.'):\n"
            "    importlib.import_module(module.name)\n"
            "import megatron.performance_model\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch')[:3])")
    output = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert output.strip() == "[]", output


# Family names compared outside the family's own module mean a decision that belongs in the
# family record. megatron/core/config.py puts the default (1f1b) first in the choices.
FAMILY_COMPARISON = re.compile(r"""(==|!=)\s*["'](chimera|gpipe|interleaved-1f1b)["']""")
SCANNED = ("megatron/core", "megatron/training/checkpoint_conversion.py",
           "megatron/training/checkpointing", "tools/show_schedule.py",
           "tools/convert_checkpoint.py")


def test_no_schedule_family_branches_outside_the_family_modules():
    offenders = []
    for scanned in SCANNED:
        path = os.path.join(ROOT, scanned)
        files = [path] if path.endswith(".py") else [
            os.path.join(folder, name) for folder, _, names in os.walk(path)
            for name in names if name.endswith(".py")]
        for file in files:
            if os.sep + os.path.join("planning", "schedules") + os.sep in file:
                continue
            with open(file) as handle:
                for number, line in enumerate(handle, 1):
                    if FAMILY_COMPARISON.search(line):
                        offenders.append(f"{os.path.relpath(file, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
