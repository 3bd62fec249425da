"""Distributed set-up: join the process group the launcher describes and create the parallel groups.

:func:`initialize_megatron` reads rank, world size and master address from torchrun's or SLURM's
environment (:mod:`megatron.training.launch_env`), picks the backend (``nccl`` when CUDA is available,
else ``gloo``; ``--distributed-backend`` overrides), initialises ``torch.distributed`` with
``--distributed-timeout-minutes`` (a lost rank then raises instead of hanging), sets the number of CPU
threads, seeds every RNG and returns the explicit :class:`~megatron.core.parallel_state.ParallelState`
handle. Nothing is stored in module globals.
"""

from __future__ import annotations

import datetime
import os
import random
from typing import Iterable, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.distributed.timeouts import awaiting, describe_group
from megatron.core.parallel_state import ParallelState, RankLayout, create_parallel_state
from megatron.training.launch_env import (LaunchEnvironment, cuda_device_index,
                                          read_launch_environment)
from megatron.training.restarts import attempt_store


def choose_backend(parallel_config, cuda_available: Optional[bool] = None) -> str:
    """``--distributed-backend`` if given, else nccl with CUDA and gloo without."""
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    backend = parallel_config.distributed_backend or ("nccl" if cuda_available else "gloo")
    if backend == "nccl" and not cuda_available:
        raise ValueError("--distributed-backend nccl needs CUDA GPUs, and none is available; use "
                         "--distributed-backend gloo (the default without GPUs)")
    return backend


def training_device(backend: str, local_rank: int,
                    device_count: Optional[int] = None) -> torch.device:
    """The device this rank computes on: with nccl, GPU ``local_rank % device_count`` of those
    visible (``device_count`` defaults to ``torch.cuda.device_count()``; one per task under
    ``srun --gpus-per-task=1``, see :func:`~megatron.training.launch_env.cuda_device_index`),
    else the CPU."""
    if backend == "nccl":
        device_count = torch.cuda.device_count() if device_count is None else device_count
        return torch.device("cuda", cuda_device_index(local_rank, device_count))
    return torch.device("cpu")


def cpu_threads_per_rank(env: Mapping[str, str], local_world_size: int,
                         cpu_count: Optional[int] = None) -> int:
    """Intra-op threads for this rank: ``OMP_NUM_THREADS`` if set, else the node's cores shared
    evenly by its ranks (oversubscribing cores makes every rank slower)."""
    if env.get("OMP_NUM_THREADS"):
        try:
            return max(1, int(env["OMP_NUM_THREADS"]))
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']!r} is not an integer; fix "
                             f"or unset it") from None
    cpu_count = cpu_count or os.cpu_count() or 1
    return max(1, cpu_count // max(1, local_world_size))


def set_random_seeds(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) identically on every rank.

    The model derives its initial weights and dropout masks from the seed and layout-independent
    keys, so the same seed on every rank is what makes layouts comparable.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _local_world_size(env: Mapping[str, str], launch: LaunchEnvironment) -> int:
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return launch.world_size if launch.launcher == "none" else 1


def initialize_megatron(config, *, env: Optional[Mapping[str, str]] = None,
                        extra_group_ranks: Iterable[Iterable[int]] = ()) -> ParallelState:
    """Initialise torch.distributed from the launch environment and return the ParallelState.

    ``config`` is a validated :class:`~megatron.core.config.MegatronConfig`. ``extra_group_ranks``
    lists further process groups to create (e.g. Chimera replica groups; see
    :class:`megatron.core.runtimes.TrainingRuntime`). If torch.distributed is already initialised
    (tests, notebooks) it is reused.
    """
    env = os.environ if env is None else env
    launch = read_launch_environment(env)
    parallel = config.parallel
    if launch.launcher != "none" and not dist.is_initialized():
        # Several ranks per node: share the cores instead of each rank using all of them. A plain
        # process (or one whose group the caller created) keeps the threads it was given.
        torch.set_num_threads(cpu_threads_per_rank(env, _local_world_size(env, launch)))
    backend = choose_backend(parallel)
    if backend == "nccl":
        torch.cuda.set_device(training_device(backend, local_rank_from_environment(config, env)))

    rank, world_size = launch.rank, launch.world_size
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if world_size > 1 and not dist.is_initialized():
        if launch.launcher == "torchrun":
            # torchrun's store, under a prefix per restart attempt (see restarts.attempt_store)
            dist.init_process_group(
                backend=backend, store=attempt_store(env, rank, world_size, timeout,
                                                     master_addr=launch.master_addr,
                                                     master_port=launch.master_port),
                rank=rank, world_size=world_size, timeout=timeout)
        else:
            host = launch.master_addr
            init_method = f"tcp://[{host}]:{launch.master_port}" if ":" in host else \
                f"tcp://{host}:{launch.master_port}"
            dist.init_process_group(
                backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                timeout=timeout)
    elif dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    if parallel.world_size is not None and parallel.world_size != world_size:
        raise ValueError(f"the config was validated for {parallel.world_size} processes but the "
                         f"job has {world_size}; parse the arguments in the launched processes "
                         f"(parse_args reads WORLD_SIZE / SLURM_NTASKS) or pass world_size=")

    layout = RankLayout.from_world_size(world_size, parallel.tensor_model_parallel_size,
                                        parallel.pipeline_model_parallel_size)
    if world_size > 1:
        state = create_parallel_state(layout, rank, backend, extra_group_ranks=extra_group_ranks,
                                      timeout=timeout)
    else:
        state = ParallelState(layout=layout, rank=0, backend=backend)
    set_random_seeds(config.training.seed)
    return state


def shutdown_distributed(finished: bool) -> None:
    """Tear down torch.distributed at the end of a run (every path: success, error, signal).

    A finished run first waits at a barrier, so that no rank destroys its groups (and exits) while
    a peer still has collectives or point-to-point transfers in flight with it; then every process
    group is destroyed explicitly. Left to interpreter exit, gloo's background threads and pending
    work were torn down in arbitrary order, and about 1 launch in 10 ended, after its last log line,
    in ``terminate called without an active exception`` (SIGABRT, exit status 1). A failed run skips
    the barrier (a peer may be the one that failed) and only destroys the groups; the barrier and
    every collective are bounded by ``--distributed-timeout-minutes``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if finished and dist.get_world_size() > 1:
            with awaiting(lambda: "the end-of-training barrier on "
                                  + describe_group("world", dist.group.WORLD)):
                dist.barrier()
    finally:
        dist.destroy_process_group()


def local_rank_from_environment(config, env: Optional[Mapping[str, str]] = None) -> int:
    """This process's local rank on its node (its GPU: see :func:`training_device`)."""
    launch = read_launch_environment(os.environ if env is None else env)
    return launch.local_rank if launch.launcher != "none" else (config.parallel.local_rank or 0)
