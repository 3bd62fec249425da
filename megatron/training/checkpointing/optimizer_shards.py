"""Sharded optimizer state (``--use-distributed-optimizer``) in a checkpoint.

The rank file of a (tensor, pipeline) position records only a marker; every data-parallel rank writes
its shard of the optimizer state to ``distrib_optim_dpNNN.pt`` next to it, with the shard layout
that :mod:`.resharding` maps to global keys to fill another data-parallel size's shards. Loading
needs the same ``--use-distributed-optimizer`` setting (the error says how to load the weights only instead);
at the saved data-parallel size each rank reads its own shard file, at another size they are read
through their global keys (:mod:`.resharding`).
"""

from __future__ import annotations

import os

from megatron.training.checkpointing.files import (METADATA_FILENAME, CheckpointError,
                                                  _verify_file, file_crc32, load_file,
                                                  rank_dir_name, save_file)
from megatron.training.checkpointing.resharding import resharded_optimizer_state


def is_sharded(optimizer) -> bool:
    return hasattr(optimizer, "shards")


def optimizer_state_entry(optimizer, data_parallel_size: int) -> dict:
    """What the rank file records as its optimizer state."""
    if is_sharded(optimizer):
        return {"sharded": True, "data_parallel_size": data_parallel_size}
    return optimizer.state_dict()


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
    save_file({**header, "optimizer": components.optimizer.state_dict(),
               "shard_layout": components.optimizer.shard_layout()}, path)
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
        return resharded_optimizer_state(os.path.join(position_dir, optimizer_shard_name(0)),
                                         iteration_dir, metadata, components)
    relative = os.path.join(position_dir, optimizer_shard_name(parallel_state.dp_rank))
    recorded = metadata["files"].get(relative)
    if recorded is None:
        raise CheckpointError(f"{os.path.join(iteration_dir, METADATA_FILENAME)} lists no "
                              f"{relative}; the checkpoint is incomplete")
    shard_path = os.path.join(iteration_dir, relative)
    _verify_file(shard_path, recorded)
    return load_file(shard_path)["optimizer"]
