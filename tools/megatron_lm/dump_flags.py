#!/usr/bin/env python
"""Write tests/golden/megatron_flags_<commit>.txt: every option string of Megatron-LM's argument
parser at one commit, with its value syntax, read by building Megatron's own parser.

    git -C MEGATRON_LM archive COMMIT megatron | tar -x -C /tmp/mlm
    PYTHONPATH=/tmp/mlm python tools/megatron_lm/dump_flags.py COMMIT OUT.txt

Megatron-LM's imports pull in optional GPU packages (triton kernels); the modules named in
STUBBED_MODULES are replaced by empty stand-ins, which is enough to build the parser (nothing is
run). Each line: ``FLAG switch``, ``FLAG value [CHOICE,CHOICE,...]`` or ``FLAG list``.
"""

import argparse
import importlib.abc
import importlib.machinery
import sys
import typing
from unittest import mock

STUBBED_MODULES = ("megatron.core.transformer.moe.ops", "megatron.core.ssm.ops")


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == stub or name.startswith(stub + ".") for stub in STUBBED_MODULES):
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


def flag_lines(parser: argparse.ArgumentParser) -> list[str]:
    lines = []
    for action in parser._actions:
        if not action.option_strings or action.option_strings == ["-h", "--help"]:
            continue
        if action.nargs == 0:
            kind = "switch"
        elif action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
            kind = "list"
        else:
            kind = "value"
        choices = [str(choice) for choice in action.choices] if action.choices else []
        # Enum-typed choices (AttnBackend.flash) are written by users as their plain names.
        shown = "" if not choices or any("." in c for c in choices) else " " + ",".join(choices)
        lines += [f"{option} {kind}{shown}" for option in action.option_strings]
    return lines


def main() -> None:
    commit, out = sys.argv[1], sys.argv[2]
    sys.meta_path.insert(0, _StubFinder())
    if not hasattr(typing, "override"):  # Megatron-LM uses Python 3.12's typing.override
        typing.override = lambda function: function
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    header = [f"# Every option string of Megatron-LM's argument parser at commit {commit},",
              "# read by building the parser (megatron.training.arguments.add_megatron_arguments)",
              "# and listing its actions (tools/megatron_lm/dump_flags.py):",
              "# FLAG switch | FLAG value [CHOICE,CHOICE,...] | FLAG list (nargs + or * or a count).",
              "# tests/unit/test_megatron_flag_catalog.py checks that each one is classified."]
    with open(out, "w") as file:
        file.write("\n".join(header + flag_lines(parser)) + "\n")


if __name__ == "__main__":
    main()
