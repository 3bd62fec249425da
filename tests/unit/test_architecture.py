"""The architecture's promises that a reader cannot check at a glance (docs/architecture.md)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.distributed  # starts a process
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


def _megatron_modules() -> dict:
    """{dotted module name: (file, is package)} for every module under megatron/."""
    modules = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "megatron")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-len(".py")].split(os.sep)
                is_package = parts[-1] == "__init__"
                modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def megatron_import_graph() -> dict:
    """{module: set of megatron modules it imports}, from every import statement in the file,
    those inside functions and classes included (they run too, only later). ``from pkg import
    name`` points at ``pkg.name`` when that is a module, otherwise at ``pkg``."""
    modules = _megatron_modules()

    def existing(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, (path, is_package) in modules.items():
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        package = module if is_package else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(existing(alias.name) for alias in node.names
                               if alias.name.split(".")[0] == "megatron")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "megatron":
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in modules else existing(source))
        graph[module] = targets - {None, module}
    return graph


def import_cycles(graph: dict) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module."""
    order, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(module):  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in order:
            visit(module)
    cycles = []
    for component in components:  # a shortest way back to the start, within the component
        start = min(component)
        paths, frontier = {start: [start]}, [start]
        while frontier:
            module = frontier.pop(0)
            for target in sorted(graph[module] & component):
                if target == start:
                    frontier = []
                    cycles.append(paths[module] + [start])
                    break
                if target not in paths:
                    paths[target] = paths[module] + [target]
                    frontier.append(target)
    return cycles


def test_the_cycle_finder_sees_cycles_through_function_level_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    # the checkpointer's restore needs TrainingState: imported from its own module
    checkpointer = megatron_import_graph()["megatron.training.checkpointing.checkpointer"]
    assert "megatron.training.training_state" in checkpointer


def test_megatron_has_no_import_cycles():
    cycles = import_cycles(megatron_import_graph())
    assert not cycles, "import cycles (imports inside functions count too):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)
