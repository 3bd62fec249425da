"""Distributed set-up decisions that need no processes: backend, device, threads, seeding."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.initialize import (choose_backend, cpu_threads_per_rank,
                                          initialize_megatron, set_random_seeds,
                                          training_device)


def test_backend_defaults_and_override():
    parallel = SimpleNamespace(distributed_backend=None)
    assert choose_backend(parallel, cuda_available=True) == "nccl"
    assert choose_backend(parallel, cuda_available=False) == "gloo"
    assert choose_backend(SimpleNamespace(distributed_backend="gloo"), cuda_available=True) == "gloo"
    with pytest.raises(ValueError, match="--distributed-backend gloo"):
        choose_backend(SimpleNamespace(distributed_backend="nccl"), cuda_available=False)


def test_device_follows_backend():
    assert training_device("gloo", 3) == torch.device("cpu")
    assert training_device("nccl", 3, device_count=8) == torch.device("cuda", 3)
    # srun --gpus-per-task=1: local rank 3 sees one GPU, device 0
    assert training_device("nccl", 3, device_count=1) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="none is visible"):
        training_device("nccl", 3, device_count=0)


def test_threads_share_the_cores_unless_omp_num_threads_is_set():
    assert cpu_threads_per_rank({}, local_world_size=4, cpu_count=16) == 4
    assert cpu_threads_per_rank({}, local_world_size=8, cpu_count=2) == 1
    assert cpu_threads_per_rank({"OMP_NUM_THREADS": "3"}, local_world_size=8, cpu_count=16) == 3
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        cpu_threads_per_rank({"OMP_NUM_THREADS": "many"}, 1)


def test_seeding_is_reproducible():
    set_random_seeds(5)
    first = (torch.rand(2), np.random.rand())
    set_random_seeds(5)
    assert torch.equal(first[0], torch.rand(2)) and first[1] == np.random.rand()


def test_single_process_initialisation_without_a_launcher():
    config = parse_args("--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 4 "
                        "--mock-data --lr 0.1 --train-iters 1".split(), world_size=1)
    threads = torch.get_num_threads()
    state = initialize_megatron(config, env={})
    assert state.world_size == 1 and state.rank == 0 and state.backend in ("gloo", "nccl")
    assert torch.get_num_threads() == threads  # a plain process keeps its threads


def test_world_size_mismatch_is_explained():
    config = parse_args("--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 4 "
                        "--mock-data --lr 0.1 --train-iters 1 --global-batch-size 2".split(),
                        world_size=2)
    with pytest.raises(ValueError, match="validated for 2 processes"):
        initialize_megatron(config, env={})
