"""The launch scripts in examples/ pass flags that our parser accepts, for their world sizes."""

import pathlib
import re
import shlex

import pytest

from megatron.training.arguments import parse_args

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def script_argv(path: pathlib.Path) -> list[str]:
    """The pretrain_gpt.py arguments of a launch script, shell variables replaced by a word."""
    text = path.read_text().replace("\\\n", " ")
    # Flag groups: read -r -a NAME <<< "${NAME:-defaults}", used as "${NAME[@]}".
    groups = dict(re.findall(r'read -r -a (\w+) <<< "\$\{\1:-([^}]*)\}"', text))
    command = next(line for line in text.splitlines()
                   if re.search(r'pretrain_gpt\.py\s+(--|"\$\{\w+\[@\]\})', line))
    command = command.split("pretrain_gpt.py", 1)[1]
    command = re.sub(r'"\$\{(\w+)\[@\]\}"', lambda match: groups[match.group(1)], command)
    # "${NAME:-default}" -> default; other shell variables -> a placeholder word.
    command = re.sub(r'"\$\{[A-Za-z_]+:-([^}"]*)\}"', r"\1", command)
    command = re.sub(r'"\$\{?[A-Za-z_]+[^"]*"', "VALUE", command)
    return [word for word in shlex.split(command) if word != "$@"]


@pytest.mark.parametrize("name,world_size", [("pretrain_gpt_chimera_slurm.sh", 32),
                                             ("pretrain_gpt_torchrun.sh", 8),
                                             ("demo_chimera.sh", 4)])
def test_example_script_parses(name, world_size):
    argv = script_argv(EXAMPLES / name)
    config = parse_args(argv, world_size=world_size)
    assert config.parallel.pipeline_schedule == "chimera"
