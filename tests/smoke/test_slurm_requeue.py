"""Smoke (tier 3): examples/pretrain_gpt_chimera_slurm.sh survives a SLURM requeue.

There is no SLURM here, so an ``srun`` on PATH does what srun does for one node and two tasks: it
starts the command twice with SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_ID set (the rest of the
SLURM_* variables come from the "job"). The batch script runs with a tiny Chimera PP2 model (its
flag groups are replaced through the environment); the job is killed (SIGKILL to every process, as
when a node fails) after its first checkpoint, then started again with SLURM_RESTART_COUNT=1 as
SLURM's requeue does. The second run must load the newest complete checkpoint and print, for every
later iteration, the losses of an uninterrupted job.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron.training.checkpointing import read_tracker
from torchrun_helpers import REPO, free_port

pytestmark = pytest.mark.smoke

SCRIPT = pathlib.Path(REPO) / "examples" / "pretrain_gpt_chimera_slurm.sh"
TRAIN_ITERS = 12

FAKE_SRUN = """#!/usr/bin/env bash
# srun for one node: start the command once per task with the variables srun sets per task.
while [ "${1#--}" != "$1" ]; do shift; done   # srun's own options
pids=()
for ((task = 0; task < SLURM_NTASKS; task++)); do
    SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_NODEID=0 SLURM_STEP_ID=0 "$@" &
    pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""

SMALL_JOB = {
    "PARALLEL_ARGS": "--pipeline-model-parallel-size 2 --pipeline-schedule chimera",
    "MODEL_ARGS": "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                  "--max-position-embeddings 16 --vocab-size 64",
    "TRAINING_ARGS": f"--micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --log-interval 1 "
                     f"--eval-iters 0 --seed 1234 --train-iters {TRAIN_ITERS} --save-interval 3",
    "DATA_ARGS": "--mock-data",
}
LOSS = re.compile(rf" iteration +(\d+)/ +{TRAIN_ITERS} \|.*\| lm loss: ([0-9.E+-]+) \|")


def _losses(output: str) -> dict:
    return {int(i): value for i, value in LOSS.findall(output)}  # printed strings, compared exactly


def _start_job(tmp_path, checkpoint_dir, restart_count: int = 0):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "python").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    for name in ("srun", "python"):
        (bin_dir / name).chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not key.startswith("SLURM_")}
    env.update(SMALL_JOB, PATH=f"{bin_dir}:{env['PATH']}", CKPT=str(checkpoint_dir),
               SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_NTASKS="2",
               SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
               SLURM_RESTART_COUNT=str(restart_count), MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process, timeout: float) -> str:
    try:
        output = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the job did not finish within {timeout} s: {process.communicate()[0]}")
    assert process.returncode == 0, output[-4000:]
    return output


def test_requeued_job_resumes_from_the_newest_checkpoint_with_the_same_losses(tmp_path):
    straight = _losses(_finish(_start_job(tmp_path, tmp_path / "straight"), 240))
    assert sorted(straight) == list(range(1, TRAIN_ITERS + 1))

    checkpoint_dir = tmp_path / "ckpt"
    job = _start_job(tmp_path, checkpoint_dir)
    deadline = time.monotonic() + 180
    while not (os.path.isfile(checkpoint_dir / "latest_checkpointed_iteration.txt")
               and read_tracker(str(checkpoint_dir))):
        assert job.poll() is None, f"the job ended before its first checkpoint: " \
                                   f"{job.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)  # the node fails: every process of the job dies at once
    job.communicate()
    saved = read_tracker(str(checkpoint_dir))
    assert saved < TRAIN_ITERS, "the job finished before it could be killed; nothing was tested"

    output = _finish(_start_job(tmp_path, checkpoint_dir, restart_count=1), 240)
    assert "requeued (SLURM_RESTART_COUNT=1)" in output
    loaded = re.search(r"loading checkpoint from \S+ at iteration (\d+)", output)
    assert loaded, output[-3000:]
    resumed_from = int(loaded.group(1))
    assert resumed_from == saved  # the newest complete checkpoint
    resumed = _losses(output)
    assert sorted(resumed) == list(range(resumed_from + 1, TRAIN_ITERS + 1))
    assert resumed == {iteration: straight[iteration] for iteration in resumed}
