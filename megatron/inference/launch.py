"""Process setup shared by ``tools/generate.py`` and ``tools/evaluate.py``: tensor parallelism
over the launched processes (``torchrun --nproc-per-node TP``), the device, the tokenizer."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.core.parallel_state import ParallelState, RankLayout, create_parallel_state
from megatron.training.launch_env import cuda_device_index


def inference_parallel_state(device: torch.device) -> ParallelState:
    """One process: single-process state. Under torchrun: every process is one TP rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return ParallelState.single_process()
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return create_parallel_state(RankLayout(world_size, 1, 1), dist.get_rank(), backend)


def choose_device(name: Optional[str]) -> torch.device:
    """``--device`` (cpu, cuda), default cuda when available; under torchrun, the local GPU
    (``LOCAL_RANK`` modulo the visible GPUs, as in training)."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no GPU is visible; use --device cpu")
        index = cuda_device_index(int(os.environ.get("LOCAL_RANK", "0")),
                                  torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(name)


def run_tokenizer(config):
    """The checkpoint run's tokenizer, or None (mock data without one: use token ids)."""
    if config.data.tokenizer_type is None:
        return None
    from megatron.training.tokenizer import build_tokenizer
    try:
        return build_tokenizer(config.data, config.model)
    except (OSError, ValueError) as error:
        raise ValueError(f"the checkpoint's tokenizer cannot be built ({error}); pass "
                         f"--vocab-file/--merge-file or --tokenizer-model with the files") from None


def override_tokenizer_files(config, vocab_file=None, merge_file=None, tokenizer_model=None):
    """Point the config at moved tokenizer files."""
    for name, value in (("vocab_file", vocab_file), ("merge_file", merge_file),
                        ("tokenizer_model", tokenizer_model)):
        if value is not None:
            setattr(config.data, name, value)


def load_for_inference(args):
    """What both tools start from: (device, parallel state, model, config, tokenizer) from their
    shared flags (``--device``, ``--load``, ``--iteration`` and the tokenizer-file overrides)."""
    from megatron.inference.loading import load_model
    device = choose_device(args.device)
    state = inference_parallel_state(device)
    model, config = load_model(args.load, state, args.iteration, device)
    override_tokenizer_files(config, args.vocab_file, args.merge_file, args.tokenizer_model)
    return device, state, model, config, run_tokenizer(config)
