"""Tier 0: rank, world size and master address from torchrun's or SLURM's environment, and SLURM
node-list expansion."""

import pytest

from megatron.training.launch_env import (DEFAULT_MASTER_PORT, LaunchEnvironment,
                                          cuda_device_index, expand_nodelist,
                                          read_launch_environment, world_size_from_environment)


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("a,b", ["a", "b"]),
    ("node[003-005,010]", ["node003", "node004", "node005", "node010"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("gpu[1-2],cpu07,io[09-10]", ["gpu1", "gpu2", "cpu07", "io09", "io10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("nid[00098]", ["nid00098"]),
    ("login.cluster.org", ["login.cluster.org"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-", "node]1[", "node[5-3]", "node[a-b]", ""])
def test_malformed_nodelist_is_an_error(nodelist):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(nodelist)


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
           "MASTER_PORT": "6000"}
    assert read_launch_environment(env) == LaunchEnvironment(5, 8, 1, "10.0.0.2", 6000, "torchrun")


def test_torchrun_wins_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_NODELIST": "x[1-2]"}
    launch = read_launch_environment(env)
    assert (launch.rank, launch.world_size, launch.launcher) == (1, 2, "torchrun")


def test_slurm_environment_uses_first_host_of_nodelist():
    env = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "gpu[007-010],gpu100"}
    assert read_launch_environment(env) == LaunchEnvironment(13, 16, 1, "gpu007",
                                                             DEFAULT_MASTER_PORT, "slurm")
    env["MASTER_ADDR"], env["MASTER_PORT"] = "head", "7000"
    launch = read_launch_environment(env)
    assert (launch.master_addr, launch.master_port) == ("head", 7000)


def test_slurm_falls_back_to_slurm_nodelist():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "1", "SLURM_NODELIST": "b,a"}
    assert read_launch_environment(env).master_addr == "b"


def test_a_malformed_slurm_nodelist_names_the_variable_and_the_way_around_it():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "node[01-02"}
    with pytest.raises(ValueError, match=r"unbalanced '\[' in SLURM node list 'node\[01-02'.*"
                                         r"fix SLURM_JOB_NODELIST .* or set MASTER_ADDR"):
        read_launch_environment(env)
    env["MASTER_ADDR"] = "node01"  # given: the list is not read
    assert read_launch_environment(env).master_addr == "node01"


def test_no_launcher_is_one_process():
    assert read_launch_environment({}) == LaunchEnvironment(0, 1, 0, "127.0.0.1",
                                                            DEFAULT_MASTER_PORT, "none")
    assert world_size_from_environment({}) == 1
    assert world_size_from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "3",
                                        "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n1"}) == 3


@pytest.mark.parametrize("env,words", [
    ({"RANK": "0"}, "WORLD_SIZE not set"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is outside world size 4"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is not"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"},
     "SLURM_JOB_NODELIST, which is not set"),
])
def test_inconsistent_environment_is_an_error(env, words):
    with pytest.raises(ValueError) as error:
        read_launch_environment(env)
    assert words in str(error.value)


# What an sbatch script sees (``sbatch --nodes 2 --ntasks-per-node 4``): rank 0 of the job's 8
# tasks, but no srun step (the batch step).
BATCH_STEP = {"SLURM_JOB_ID": "1234", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n[1-2]"}


@pytest.mark.parametrize("step", [None, "batch", "4294967294", "interactive", "4294967290",
                                  "extern"])
def test_python_in_the_batch_script_without_srun_is_refused(step):
    env = dict(BATCH_STEP) if step is None else dict(BATCH_STEP, SLURM_STEP_ID=step)
    with pytest.raises(ValueError) as error:
        read_launch_environment(env)
    message = str(error.value)
    assert "SLURM_NTASKS=8" in message and "batch script" in message
    assert "srun python pretrain_gpt.py" in message and "torchrun" in message
    assert ("SLURM_STEP_ID is not set" if step is None else f"SLURM_STEP_ID={step}") in message


def test_srun_steps_and_single_task_batch_jobs_are_accepted():
    for step_variable in ("SLURM_STEP_ID", "SLURM_STEPID"):  # the newer and the older name
        launch = read_launch_environment(dict(BATCH_STEP, **{step_variable: "0"}))
        assert (launch.rank, launch.world_size, launch.launcher) == (0, 8, "slurm")
    # One task: the batch script is the whole job, `python pretrain_gpt.py` is right there.
    assert read_launch_environment(dict(BATCH_STEP, SLURM_NTASKS="1")).world_size == 1
    # torchrun started from the batch script sets its own variables, which win.
    launch = read_launch_environment(dict(BATCH_STEP, RANK="3", WORLD_SIZE="4", LOCAL_RANK="3"))
    assert (launch.rank, launch.world_size, launch.launcher) == (3, 4, "torchrun")


@pytest.mark.parametrize("local_rank,device_count,index", [
    (0, 8, 0), (5, 8, 5),   # every GPU of the node visible: the local rank
    (5, 1, 0), (7, 1, 0),   # srun --gpus-per-task=1 / --gpu-bind: each task sees its own GPU
    (5, 4, 1),              # e.g. two GPUs per task visible
])
def test_cuda_device_is_local_rank_modulo_visible_devices(local_rank, device_count, index):
    assert cuda_device_index(local_rank, device_count) == index


def test_no_visible_cuda_device_is_explained():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES.*--distributed-backend gloo"):
        cuda_device_index(0, 0)
