"""Optimizer state in a legacy (``--ckpt-format torch``) checkpoint.

A replicated optimizer's state is in the rank file of its (tensor, pipeline) position; with
``--use-distributed-optimizer`` the rank file records only a marker and every data-parallel rank
writes its shard of the state to ``distrib_optim_dpNNN.pt`` next to it. Either records, next to
the torch optimizer's state, its ``state_keys`` (:func:`.global_keys.optimizer_state_keys`: what
each position of the state is, by parameter name), so that another layout or data-parallel size
reads it through the global keys (:mod:`.resharding`). Loading needs the same
``--use-distributed-optimizer`` setting (the error says how to load the weights only instead); at
the saved data-parallel size each rank reads its own shard file.
"""

from __future__ import annotations

import os

from megatron.training.checkpointing.files import (METADATA_FILENAME, CheckpointError,
                                                  _verify_file, file_crc32, load_file,
                                                  rank_dir_name, save_file)
from megatron.training.checkpointing.global_keys import optimizer_state_keys
from megatron.training.checkpointing.resharding import resharded_optimizer_state


def is_sharded(optimizer) -> bool:
    return hasattr(optimizer, "shards")


def optimizer_state_entry(components) -> dict:
    """What the rank file records as its optimizer state: a marker (distributed optimizer), or
    the state with its ``state_keys``."""
    if is_sharded(components.optimizer):
        return {"sharded": True, "data_parallel_size": components.parallel_state.dp_size}
    return named_optimizer_state(components)


def named_optimizer_state(components) -> dict:
    """This rank's optimizer state dict with its ``state_keys`` (what each position is, by
    parameter name)."""
    optimizer = components.optimizer
    return {**optimizer.state_dict(),
            "state_keys": optimizer_state_keys(optimizer, components.model_chunks)}


def optimizer_shard_name(dp_rank: int) -> str:
    """``distrib_optim_dp000.pt``: one data-parallel rank's optimizer shard of a position."""
    return f"distrib_optim_dp{dp_rank:03d}.pt"


def write_optimizer_shard(components, header: dict, staging_dir: str) -> tuple[str, dict]:
    """Write this rank's optimizer shard; return (relative path, {size, crc32})."""
    parallel_state = components.parallel_state
    relative = os.path.join(rank_dir_name(parallel_state.tp_rank, parallel_state.pp_rank,
                                          parallel_state.pp_size),
                            optimizer_shard_name(parallel_state.dp_rank))
    path = os.path.join(staging_dir, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({**header, "optimizer": named_optimizer_state(components)}, path)
    return relative, {"size": os.path.getsize(path), "crc32": file_crc32(path)}


def optimizer_state_for_this_rank(path: str, saved: dict, components, iteration_dir: str,
                                  metadata: dict) -> dict:
    """The optimizer state this rank loads: the rank file's, or its shard file's (checked)."""
    parallel_state = components.parallel_state
    saved_sharded = bool(saved.get("sharded"))
    if saved_sharded != is_sharded(components.optimizer):
        was, now = (("with", "without") if saved_sharded else ("without", "with"))
        raise CheckpointError(
            f"checkpoint file {path} was saved {was} --use-distributed-optimizer and this run is "
            f"{now} it; resume with the same setting, or load the weights only with "
            f"--no-load-optim (the optimizer state starts afresh)")
    if not saved_sharded:
        return saved
    position_dir = os.path.relpath(os.path.dirname(path), iteration_dir)
    if saved["data_parallel_size"] != parallel_state.dp_size:
        return resharded_optimizer_state(components, iteration_dir, metadata)
    relative = os.path.join(position_dir, optimizer_shard_name(parallel_state.dp_rank))
    recorded = metadata["files"].get(relative)
    if recorded is None:
        raise CheckpointError(f"{os.path.join(iteration_dir, METADATA_FILENAME)} lists no "
                              f"{relative}; the checkpoint is incomplete")
    shard_path = os.path.join(iteration_dir, relative)
    _verify_file(shard_path, recorded)
    return load_file(shard_path)["optimizer"]
