"""Cutting saved distributed-optimizer state into the shards of another number of replicas.

Each ``distrib_optim_dpNNN.pt`` records, next to the torch optimizer state of its rank, the
*shard layout* of :meth:`~megatron.core.optimizer.distributed.DistributedOptimizer.shard_layout`:
for every optimizer parameter, either a shard (stage, segment, start, length, unpadded total) or
the position of a whole (replicated) parameter. A segment's flat buffer holds the same elements in
the same order whatever the number of replicas (only the padding at its end differs), so the
pieces of every saved shard of a stage, placed at their recorded starts, give the stage's whole
optimizer state; a run with another data-parallel size (or pipeline layout of the same stages)
takes its own slice from it. Per-element state (Adam's two moments) is cut; per-parameter scalars
(the step count) are the same in every piece and copied.

Resharding reads the shard files of every pipeline position of this tensor-parallel rank (a
stage's replicas live on two pipeline ranks under Chimera), so it briefly holds a whole
tensor-parallel slice of the optimizer state; a resume at the saved size reads only its own file.
"""

from __future__ import annotations

import os
import re

import torch

from megatron.training.checkpointing.files import (METADATA_FILENAME, CheckpointError,
                                                  _verify_file, load_file)

_SHARD_FILE = re.compile(r"^(mp_rank_(\d+)(?:_\d+)?)/distrib_optim_dp\d+\.pt$")


def tensor_parallel_shard_files(metadata: dict, tp_rank: int) -> list[str]:
    """Relative paths of every optimizer shard file of tensor-parallel rank ``tp_rank``."""
    found = []
    for relative in sorted(metadata["files"]):
        match = _SHARD_FILE.match(relative.replace(os.sep, "/"))
        if match and int(match.group(2)) == tp_rank:
            found.append(relative)
    return found


def _load_pieces(iteration_dir: str, metadata: dict, relatives: list[str]) -> dict:
    """{relative path: (shard layout, optimizer state dict)} of each listed file, each read once
    and verified against the metadata."""
    pieces = {}
    for relative in relatives:
        path = os.path.join(iteration_dir, relative)
        _verify_file(path, metadata["files"][relative])
        payload = load_file(path)
        if "shard_layout" not in payload:
            raise CheckpointError(f"checkpoint file {path} predates resharding (no shard layout); "
                                  f"resume with its data-parallel size or pass --no-load-optim")
        pieces[relative] = (payload["shard_layout"], payload["optimizer"])
    return pieces


def _whole_segments(pieces) -> dict:
    """{(stage, segment): (total, {state key: whole tensor or scalar}, covered ranges)} from every
    saved shard; the padding past a segment's ``total`` elements is dropped."""
    whole: dict = {}
    for layout, optimizer_state in pieces:
        states = optimizer_state["optimizer"]["state"]
        for index, entry in enumerate(layout):
            if entry[0] != "shard" or index not in states:
                continue
            _, stage, segment, start, length, total = entry
            _, tensors, covered = whole.setdefault((stage, segment), (total, {}, []))
            end = min(start + length, total)
            covered.append((start, end))
            for key, value in states[index].items():
                if torch.is_tensor(value) and value.numel() == length and length > 1:
                    buffer = tensors.setdefault(key, value.new_zeros(total))
                    if end > start:
                        buffer[start:end] = value.reshape(-1)[:end - start]
                else:
                    tensors.setdefault(key, value)
    for (stage, segment), (total, _, covered) in whole.items():
        reached = 0
        for begin, end in sorted(covered):
            if begin > reached:
                break
            reached = max(reached, end)
        if reached < total:
            raise CheckpointError(f"the saved optimizer shards of stage {stage}, segment "
                                  f"{segment} cover only {reached} of {total} elements; the "
                                  f"checkpoint is incomplete (pass --no-load-optim)")
    return whole


def _cut(entry: tuple, whole: dict) -> dict:
    """This run's state of one shard parameter, cut from the whole segment."""
    _, stage, segment, start, length, total = entry
    if (stage, segment) not in whole:
        raise CheckpointError(f"the checkpoint holds no optimizer state for stage {stage}, "
                              f"segment {segment}; it was saved from another model or layout "
                              f"(pass --no-load-optim)")
    saved_total, tensors, _ = whole[(stage, segment)]
    if saved_total != total:
        raise CheckpointError(f"stage {stage}, segment {segment} has {saved_total} elements in "
                              f"the checkpoint and {total} in this run; pass --no-load-optim")
    state = {}
    for key, value in tensors.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() >= total > 1:
            piece = value.new_zeros(length)
            end = min(start + length, total)
            if end > start:
                piece[:end - start] = value[start:end]
            state[key] = piece
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value
    return state


def resharded_optimizer_state(own_relative: str, iteration_dir: str, metadata: dict,
                              tp_rank: int, current_layout: list[tuple]) -> dict:
    """This rank's optimizer state dict for ``current_layout``, assembled from every saved shard
    of its tensor-parallel rank; whole (replicated) parameters and the scalar state come from
    ``own_relative`` (a shard file of this rank's pipeline position, relative to the iteration)."""
    relatives = tensor_parallel_shard_files(metadata, tp_rank)
    if own_relative not in relatives:
        raise CheckpointError(f"{os.path.join(iteration_dir, METADATA_FILENAME)} lists no "
                              f"{own_relative}; the checkpoint is incomplete")
    pieces = _load_pieces(iteration_dir, metadata, relatives)
    whole = _whole_segments(pieces.values())
    own_layout, own_state = pieces[own_relative]
    replicated = {entry[1]: own_state["optimizer"]["state"].get(index)
                  for index, entry in enumerate(own_layout) if entry[0] == "replicated"}
    state = {}
    for index, entry in enumerate(current_layout):
        if entry[0] == "shard":
            state[index] = _cut(entry, whole)
        elif replicated.get(entry[1]) is not None:
            state[index] = replicated[entry[1]]
    groups = own_state["optimizer"]["param_groups"]
    result = {key: value for key, value in own_state.items() if key != "optimizer"}
    result["optimizer"] = {"state": state, "param_groups": groups}
    return result
