#!/usr/bin/env python
"""Write tests/data/megatron_gpt_launch_configs.jsonl from a Megatron-LM git directory: the
launch configurations that tests/unit/test_megatron_launch_collection.py parses.

    python tools/megatron_lm/build_launch_configs.py MEGATRON_LM_GIT_DIR OUT.jsonl

Collected (one JSON object a line: name, source, world_size, argv):

- functional-2026 / functional-2024: the MODEL_ARGS of every GPT functional test
  (tests/functional_tests/test_cases/gpt/*/model_config.yaml) at d98e8a6 and 3efa8c2 whose MODE is
  pretraining and that is not a model-optimizer distillation run (those start other entry points);
  ``true`` becomes a switch, ``false`` is left out, a list flag's value is split into words.
- canonical: every version of Megatron-LM's classic GPT example scripts, and examples: its current
  example scripts that run pretrain_gpt.py. Each script runs under bash with the launchers
  (torchrun, python, srun) replaced by a printer of their arguments, ``<placeholders>`` filled in.
- sc21: the SC21 (PTD-P paper) scripts with every option combination their comments list.

Data, tokenizer, checkpoint and log paths become fixed names (PATHS); other shell variables
become ``path``. The world size is the script's own (nodes x GPUs per node) when it fits the
layout and batch, else the smallest of 8, 16, 32, ... GPUs that does.
"""

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

import yaml

FUNCTIONAL_COMMITS = (("d98e8a64ddf34856e74b24714e3bedb2f5a39553", "functional-2026"),
                      ("3efa8c2", "functional-2024"))
CANONICAL_SCRIPTS = ("examples/pretrain_gpt.sh", "examples/pretrain_gpt_single_node.sh",
                     "examples/pretrain_gpt_distributed.sh",
                     "examples/pretrain_gpt_distributed_with_mp.sh",
                     "examples/pretrain_gpt3_175B.sh",
                     "examples/gpt3/train_gpt3_175b_distributed.sh")
SC21_COMMIT = "f2e72c8a16~1"  # the last commit with examples/sc21/
PATHS = {"--data-path": "my-gpt2_text_document", "--vocab-file": "gpt2-vocab.json",
         "--merge-file": "gpt2-merges.txt", "--tokenizer-model": "tokenizer.model",
         "--save": "checkpoints", "--load": "checkpoints", "--tensorboard-dir": "tensorboard",
         "--data-cache-path": "data-cache", "--wandb-save-dir": "wandb"}
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PRINTERS = r'''
_emit(){ printf '%s\n' "$@" > "$OUT"; }
torchrun(){ _emit "$@"; }; python(){ _emit "$@"; }; python3(){ _emit "$@"; }
srun(){ while [ $# -gt 0 ] && [ "$1" != "-c" ]; do shift; done; [ $# -gt 1 ] && eval "$2"; }
mkdir(){ :; }
'''


class Repository:
    def __init__(self, git_dir: str):
        self.git_dir = git_dir

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", self.git_dir, *args], capture_output=True,
                              text=True, check=True).stdout

    def show(self, commit: str, path: str) -> str:
        return self.git("show", f"{commit}:{path}")


def groups(argv):
    result = []
    for token in argv:
        if token.startswith("--"):
            result.append([token])
        elif result:
            result[-1].append(token)
    return result


def replace_paths(argv):
    result = []
    for flag, *values in groups(argv):
        if flag in PATHS:
            values = [PATHS[flag]] if values else values
        elif flag == "--seed" and any("$" in v for v in values):
            values = ["1234"]
        elif any("$" in v or v.startswith("/") for v in values):
            values = ["path"]
        result += [flag, *values]
    return result


def fitting_world_size(argv, candidates=WORLD_SIZES):
    values = {flag: rest for flag, *rest in groups(argv)}

    def number(flag, default):
        return int(values[flag][0]) if values.get(flag) else default
    model_parallel = (number("--tensor-model-parallel-size", 1) *
                      number("--pipeline-model-parallel-size", 1) *
                      number("--context-parallel-size", 1))
    micro, global_batch = number("--micro-batch-size", 1), number("--global-batch-size", None)
    for world in candidates:
        if world % model_parallel == 0 and (
                global_batch is None or global_batch % (micro * world // model_parallel) == 0):
            return world
    # Nothing fits (Megatron-LM would refuse the batch at any size): the model-parallel size, so
    # that validation names the batch problem.
    return model_parallel if candidates == WORLD_SIZES else None


def functional_test_argv(text, flag_kinds):
    data = yaml.safe_load(text) or {}
    if data.get("MODE", "pretraining") != "pretraining":
        return None
    arguments = data.get("MODEL_ARGS")
    if not arguments or any(str(key).startswith("--export-kd") for key in arguments):
        return None
    argv = []
    for key, value in arguments.items():
        if value is True:
            argv.append(key)
        elif value is not False and value is not None:
            text_value = str(value)
            argv += [key, *text_value.split()] if flag_kinds.get(key) == "list" else \
                [key, text_value]
    return argv


def run_script(text):
    """The arguments a launch script passes to pretrain_gpt.py, and its world size (or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, script = os.path.join(tmp, "argv"), os.path.join(tmp, "script.sh")
        body = re.sub(r"<[^<>\n]*>", "placeholder", text.replace("#!/bin/bash", ""))
        with open(script, "w") as file:
            file.write(PRINTERS + body)
        open(os.path.join(tmp, "pretrain_gpt.py"), "w").close()
        subprocess.run(["bash", script, "checkpoints", "tensorboard", "gpt2-vocab.json",
                        "gpt2-merges.txt", "my-gpt2_text_document"],
                       env={"OUT": out, "PATH": os.environ["PATH"]}, capture_output=True,
                       cwd=tmp, timeout=30)
        if not os.path.exists(out):
            return None, None
        with open(out) as file:
            tokens = file.read().split("\n")[:-1]
    launcher, argv, seen = [], [], False
    for token in tokens:
        if seen:
            argv.append(token)
        elif token.endswith("pretrain_gpt.py"):
            seen = True
        else:
            launcher.append(token)
    if not seen:
        return None, None
    sizes = {}
    for index, token in enumerate(launcher):
        match = re.match(r"--(nproc[_-]per[_-]node|nnodes)(?:=(\S+))?$", token)
        if match:
            sizes[match.group(1)[:5]] = match.group(2) or launcher[index + 1]
    try:
        world = int(sizes.get("nproc", 8)) * int(sizes.get("nnode", 1))
    except ValueError:
        world = None
    if world is not None and fitting_world_size(argv, (world,)) != world:
        world = None
    return argv, world


def sc21_configs(repository):
    """Every option combination of the SC21 run_*.sh scripts, run under bash."""
    folder = "examples/sc21"
    config = repository.show(SC21_COMMIT, f"{folder}/CONFIG.sh")
    config = config.replace("<path to megatron processed data>", "'$DATA_PATH'").replace(
        "<path to bpe vocab file>", "'$VOCAB_FILE'").replace("<path to bpe merges file>",
                                                             "'$MERGE_FILE'")
    config = re.sub(r"<[^>]*>", "x", config)
    names = repository.git("ls-tree", "--name-only", SC21_COMMIT, f"{folder}/").split()
    for path in sorted(name for name in names if os.path.basename(name).startswith("run_")):
        lines = repository.show(SC21_COMMIT, path).splitlines()
        variables = []
        for index, line in enumerate(lines):
            match = re.search(r"options = \[(.*)\]", line)
            if match:
                target = index + 1
                while not re.match(r"^[A-Z_]+=", lines[target]):
                    target += 1
                variables.append((target, lines[target].split("=")[0],
                                  _expand_options(match.group(1))))
        for combination in itertools.product(*[values for _, _, values in variables]):
            text = list(lines)
            for (target, name, _), value in zip(variables, combination):
                text[target] = f"{name}={value}"
            body = "\n".join(text).replace(". `pwd`/CONFIG.sh", config).replace(
                ". `pwd`/SBATCH.sh", 'echo "$NNODES|$MEGATRON_PARAMS"')
            printed = [line for line in subprocess.run(["bash", "-c", body], capture_output=True,
                                                       text=True).stdout.splitlines() if "|" in line]
            if printed:
                nodes, params = printed[-1].split("|", 1)
                name = os.path.basename(path)[:-3] + "/" + ",".join(
                    f"{variable}={value}" for (_, variable, _), value in zip(variables, combination))
                yield f"sc21/{name}", f"f2e72c8~1:{path}", params.split(), int(nodes) * 8


def _expand_options(text):
    """``1, 2, 4, ..., 256`` (doubling) or ``12, 24, 36, ..., 60`` (steps) or a plain list."""
    items = [item.strip() for item in text.split(",")]
    if "..." not in items:
        return items
    numbers = [int(item) for item in items if item != "..."]
    if len(numbers) >= 3 and numbers[1] - numbers[0] == numbers[2] - numbers[1]:
        return [str(n) for n in range(numbers[0], numbers[-1] + 1, numbers[1] - numbers[0])]
    values = [numbers[0]]
    while values[-1] * 2 <= numbers[-1]:
        values.append(values[-1] * 2)
    return [str(value) for value in values]


def main() -> None:
    repository, out = Repository(sys.argv[1]), sys.argv[2]
    golden = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden",
                          "megatron_flags_d98e8a6.txt")
    flag_kinds = {line.split()[0]: line.split()[1] for line in open(golden)
                  if line.strip() and not line.startswith("#")}
    records, seen = [], set()

    def add(name, source, argv, world=None):
        argv = replace_paths(argv)
        world = world or fitting_world_size(argv)
        key = (name.split("/")[0], tuple(argv), world)
        if key not in seen:
            seen.add(key)
            records.append({"name": name, "source": source, "world_size": world, "argv": argv})

    for commit, label in FUNCTIONAL_COMMITS:
        listing = repository.git("ls-tree", "-r", "--name-only", commit,
                                 "tests/functional_tests/test_cases/gpt").split()
        for path in listing:
            if path.endswith("model_config.yaml"):
                argv = functional_test_argv(repository.show(commit, path), flag_kinds)
                if argv is not None:
                    add(f"{label}/{path.split('/')[-2]}", f"{commit[:7]}:{path}", argv)
    for path in CANONICAL_SCRIPTS:
        for commit in repository.git("log", "--format=%H", "--", path).split():
            try:
                argv, world = run_script(repository.show(commit, path))
            except subprocess.CalledProcessError:
                continue  # the commit that deleted the script
            if argv:
                add(f"canonical/{os.path.basename(path)}@{commit[:7]}", f"{commit[:7]}:{path}",
                    argv, world)
    head = repository.git("rev-parse", "--short=7", "HEAD").strip()
    for path in repository.git("ls-tree", "-r", "--name-only", "HEAD", "examples").split():
        if path.endswith(".sh") and "sc21" not in path and \
                not path.endswith("train_gpt3_175b_distributed.sh"):
            text = repository.show("HEAD", path)
            if "pretrain_gpt.py" in text:
                argv, world = run_script(text)
                if argv:
                    add(f"examples/{path[len('examples/'):]}", f"{head}:{path}", argv, world)
    for name, source, argv, world in sc21_configs(repository):
        add(name, source, argv, world)
    with open(out, "w") as file:
        for record in records:
            file.write(json.dumps(record, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
