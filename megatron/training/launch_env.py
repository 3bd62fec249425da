"""Where this process sits in the job, read from the launcher's environment variables.

Owns one pure function, :func:`read_launch_environment`, that understands the two launchers Megatron
users have: ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
and SLURM's ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, master = first host of
``SLURM_JOB_NODELIST``), plus :func:`expand_nodelist` for SLURM's compressed host lists such as
``node[003-005,010]``, and :func:`cuda_device_index` (the GPU a rank uses among those it sees).
A ``python pretrain_gpt.py`` started in an sbatch script without ``srun`` (one process where the
job expects several) is refused at once instead of waiting for the rendezvous to time out.
Nothing here touches torch or the real environment unless it is passed in, so
every case is unit-testable.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

DEFAULT_MASTER_ADDR = "127.0.0.1"
# torchrun's own default rendezvous port; used when a SLURM job does not set MASTER_PORT.
DEFAULT_MASTER_PORT = 29500

# SLURM job steps that are not srun task steps. Assumption (sbatch/srun man pages, slurm.h): each
# srun starts a step whose tasks get SLURM_STEP_ID (and the older SLURM_STEPID) = 0, 1, 2, ...;
# the batch script itself runs in the "batch" step, where SLURM_STEP_ID is not set (current
# versions) or, with some versions and plugins, names that step: "batch" / SLURM_BATCH_SCRIPT
# (0xfffffffe), likewise salloc's "interactive" step (0xfffffffa) and the "extern" step
# (0xffffffff). The batch script still has SLURM_PROCID=0 and SLURM_NTASKS = the job's task count.
SLURM_NON_TASK_STEPS = frozenset({"batch", "interactive", "extern",
                                  "4294967294", "4294967290", "4294967295"})


@dataclass(frozen=True)
class LaunchEnvironment:
    """Rank, world size, local rank and rendezvous address of this process."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "none" (a plain single process)


def _read_int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; "
                         f"fix the launcher's setting or unset it") from None


def _read_port(env: Mapping[str, str]) -> int:
    if "MASTER_PORT" not in env:
        return DEFAULT_MASTER_PORT
    port = _read_int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port; set it to a value in 1..65535")
    return port


def _check_rank(rank: int, world_size: int, local_rank: int, source: str) -> None:
    if world_size < 1:
        raise ValueError(f"{source}: world size {world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"{source}: rank {rank} is outside world size {world_size}; "
                         f"the launcher's variables are inconsistent")
    if local_rank < 0:
        raise ValueError(f"{source}: local rank {local_rank} must be >= 0")


def read_launch_environment(env: Optional[Mapping[str, str]] = None) -> LaunchEnvironment:
    """Read rank, world size, local rank and master address from the launcher's variables.

    torchrun's variables win when present (torchrun inside a SLURM allocation still sets them); else
    SLURM's (``srun``), where MASTER_ADDR defaults to the first host of ``SLURM_JOB_NODELIST`` (or
    ``SLURM_NODELIST``) and MASTER_PORT to 29500 unless set; else a single process (rank 0 of 1).
    ``env`` defaults to ``os.environ``.
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in env]
        if missing:
            raise ValueError(f"torchrun-style environment is incomplete: {', '.join(missing)} not "
                             f"set; launch with torchrun or set RANK and WORLD_SIZE together")
        rank, world_size = _read_int(env, "RANK"), _read_int(env, "WORLD_SIZE")
        local_rank = _read_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        _check_rank(rank, world_size, local_rank, "torchrun environment")
        return LaunchEnvironment(rank, world_size, local_rank,
                                 env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR), _read_port(env),
                                 "torchrun")
    if "SLURM_PROCID" in env:
        if "SLURM_NTASKS" not in env:
            raise ValueError("SLURM_PROCID is set but SLURM_NTASKS is not; launch with srun "
                             "(which sets both) or set SLURM_NTASKS")
        rank, world_size = _read_int(env, "SLURM_PROCID"), _read_int(env, "SLURM_NTASKS")
        local_rank = _read_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        _check_rank(rank, world_size, local_rank, "SLURM environment")
        _check_started_by_srun(env, world_size)
        master_addr = env.get("MASTER_ADDR")
        if master_addr is None:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise ValueError("under srun the master address comes from SLURM_JOB_NODELIST, "
                                 "which is not set; set MASTER_ADDR to the first node's host name")
            try:
                master_addr = expand_nodelist(nodelist)[0]
            except ValueError as error:
                raise ValueError(f"{error}: the master address is its first host; fix "
                                 f"SLURM_JOB_NODELIST (SLURM's host list, e.g. node[01-04,07]) or "
                                 f"set MASTER_ADDR to the first node's host name") from None
        return LaunchEnvironment(rank, world_size, local_rank, master_addr, _read_port(env),
                                 "slurm")
    return LaunchEnvironment(0, 1, 0, env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
                             _read_port(env), "none")


def slurm_step_id(env: Mapping[str, str]) -> Optional[str]:
    """SLURM_STEP_ID (or the older SLURM_STEPID); None outside any step."""
    return env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))


def _check_started_by_srun(env: Mapping[str, str], world_size: int) -> None:
    """Several SLURM tasks but no srun task step: the batch script ran ``python`` itself, so this
    is the only process of a job that expects ``world_size``, and the rendezvous would wait for
    the others until it timed out."""
    step = slurm_step_id(env)
    if world_size > 1 and (step is None or step.strip().lower() in SLURM_NON_TASK_STEPS):
        where = "SLURM_STEP_ID is not set" if step is None else f"SLURM_STEP_ID={step}"
        raise ValueError(
            f"SLURM_NTASKS={world_size} but this process runs in the job's batch script, not in "
            f"an srun task ({where}): one process was started where the job expects "
            f"{world_size}, and it would wait for the others until the rendezvous timed out. "
            f"Launch the tasks with srun (`srun python pretrain_gpt.py ...`, see "
            f"examples/pretrain_gpt_chimera_slurm.sh), or with torchrun on every node")


def cuda_device_index(local_rank: int, device_count: int) -> int:
    """The GPU this rank uses among the ``device_count`` it sees: ``local_rank % device_count``.

    With every GPU of the node visible (torchrun, ``srun --gpus-per-node``) that is the local rank;
    under ``srun --gpus-per-task=1`` or ``--gpu-bind`` each task sees only its own GPU, as device 0.
    """
    if device_count < 1:
        raise ValueError(f"local rank {local_rank} needs a CUDA device but none is visible to "
                         f"this process; check CUDA_VISIBLE_DEVICES and the job's --gpus options, "
                         f"or use --distributed-backend gloo")
    return local_rank % device_count


def world_size_from_environment(env: Optional[Mapping[str, str]] = None) -> int:
    """World size the launcher announced: WORLD_SIZE (torchrun), else SLURM_NTASKS, else 1."""
    return read_launch_environment(env).world_size


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append("".join(current))
    return [part for part in parts if part]


def _expand_range_list(ranges: str, nodelist: str) -> list[str]:
    """Expand the inside of one bracket: "003-005,010" -> ["003", "004", "005", "010"]."""
    names = []
    for item in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise ValueError(f"cannot read range {item!r} in SLURM node list {nodelist!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"descending range {item!r} in SLURM node list {nodelist!r}")
        width = len(first)  # SLURM keeps the zero padding of the first number
        names.extend(str(number).zfill(width) for number in range(int(first), int(last) + 1))
    return names


def _expand_host_pattern(pattern: str, nodelist: str) -> list[str]:
    """Expand one host expression; several bracket groups give their cartesian product."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[:match.start()], pattern[match.end():]
    expanded_suffixes = _expand_host_pattern(suffix, nodelist)
    return [prefix + middle + rest
            for middle in _expand_range_list(match.group(1), nodelist)
            for rest in expanded_suffixes]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, in order.

    ``"node[003-005,010]"`` -> node003, node004, node005, node010; ``"a,b"`` -> a, b;
    ``"gpu[1-2],cpu07"`` -> gpu1, gpu2, cpu07; ``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2.
    """
    hosts = [host for part in _split_top_level(nodelist.strip())
             for host in _expand_host_pattern(part.strip(), nodelist)]
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts
