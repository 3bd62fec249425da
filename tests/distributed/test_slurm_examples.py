"""examples/slurm/gpt2_paper.sh: every paper run's flags parse for its world size (DRY_RUN)."""

import os
import pathlib
import subprocess

import pytest

from megatron.training.arguments import parse_args

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "slurm" / "gpt2_paper.sh"


def dry_run(run: str, nodes: int, gpus_per_node: int = 1, **env):
    environment = {**os.environ, "DRY_RUN": "1", "SLURM_JOB_NUM_NODES": str(nodes),
                   "GPUS_PER_NODE": str(gpus_per_node), **env}
    environment.pop("DATA", None)
    done = subprocess.run(["bash", str(SCRIPT), run], capture_output=True, text=True,
                          env=environment, timeout=30)
    return done


@pytest.mark.parametrize("run,nodes,schedule,depth,recompute", [
    ("chimera", 2048, "chimera", 32, None), ("1f1b", 2048, "1f1b", 16, "full"),
    ("gpipe", 2048, "gpipe", 8, "full"), ("sweep-d64", 512, "chimera", 64, None),
    ("sweep-d32", 512, "chimera", 32, None), ("sweep-d16", 512, "chimera", 16, "full"),
    ("sweep-d8", 512, "chimera", 8, "full")])
def test_paper_run_flags_parse(run, nodes, schedule, depth, recompute):
    done = dry_run(run, nodes)
    assert done.returncode == 0, done.stderr
    world, *argv = done.stdout.splitlines()
    assert int(world) == nodes
    config = parse_args(argv, world_size=int(world))
    assert config.parallel.pipeline_schedule == schedule
    assert config.parallel.pipeline_model_parallel_size == depth
    assert config.parallel.data_parallel_size == nodes // depth
    assert config.training.global_batch_size == nodes
    assert config.recompute.recompute_granularity == recompute
    assert config.model.num_layers == 64 and config.model.seq_length == 632


def test_gpus_per_node_scales_the_world():
    done = dry_run("chimera", 256, gpus_per_node=8)
    world, *argv = done.stdout.splitlines()
    config = parse_args(argv, world_size=int(world))
    assert int(world) == 2048 and config.parallel.data_parallel_size == 64


def test_unknown_run_is_rejected():
    done = dry_run("pipedream", 8)
    assert done.returncode == 2 and "unknown run 'pipedream'" in done.stderr
