"""Distributed-optimizer state of a legacy (``--ckpt-format torch``) checkpoint for another number
of replicas: the saved shard files are mapped to the global keys of :mod:`.global_keys` and this
rank's shards are filled from them the way a torch_dist checkpoint is read.

Each ``distrib_optim_dpNNN.pt`` records, next to its rank's torch optimizer state, the shard layout
of :meth:`~megatron.core.optimizer.distributed.DistributedOptimizer.shard_layout`: for every
optimizer parameter a shard ``(stage, segment, start, length, unpadded total)`` or the position of a
whole (replicated) parameter. The parameters of a (stage, segment) are the same in every run of the
same tensor/pipeline layout (only the data-parallel size differs), so this run's segment names the
parameters a saved flat range covers: the range becomes boxes of ``optimizer.state.<state>.<name>``
(:func:`~.global_keys.add_flat_shard`), exactly as a torch_dist save would key them. This rank reads
the shard files of its tensor-parallel rank (a stage's replicas live on two pipeline ranks under
Chimera) and keeps the stages it hosts.
"""

from __future__ import annotations

import os
import re

from megatron.training.checkpointing.files import (METADATA_FILENAME, CheckpointError,
                                                  _verify_file, load_file)
from megatron.training.checkpointing.global_keys import (PieceSet, add_flat_shard,
                                                        empty_optimizer_states, fill_from,
                                                        named_parameters_by_id, optimizer_params,
                                                        optimizer_pieces, scalar_state_fallbacks)

_SHARD_FILE = re.compile(r"^(mp_rank_(\d+)(?:_\d+)?)/distrib_optim_dp\d+\.pt$")


def tensor_parallel_shard_files(metadata: dict, tp_rank: int) -> list[str]:
    """Relative paths of every optimizer shard file of tensor-parallel rank ``tp_rank``."""
    found = []
    for relative in sorted(metadata["files"]):
        match = _SHARD_FILE.match(relative.replace(os.sep, "/"))
        if match and int(match.group(2)) == tp_rank:
            found.append(relative)
    return found


def _read_shard_file(iteration_dir: str, metadata: dict, relative: str) -> dict:
    path = os.path.join(iteration_dir, relative)
    _verify_file(path, metadata["files"][relative])
    payload = load_file(path)
    if "shard_layout" not in payload:
        raise CheckpointError(f"checkpoint file {path} predates resharding (no shard layout); "
                              f"resume with its data-parallel size or pass --no-load-optim")
    return payload


def saved_shard_pieces(payloads: dict, optimizer, model_chunks, tp_rank: int,
                       tp_size: int) -> PieceSet:
    """Every saved shard (``payloads``: {relative path: shard file}) of a stage this rank hosts,
    as pieces of global tensors."""
    names = named_parameters_by_id(model_chunks)
    segments = {(reducer.stage_id, index): (segment.params, total)
                for reducer in optimizer.sharded_reducers
                for index, (segment, (_, _, total)) in enumerate(zip(reducer.segments,
                                                                     reducer.shard_ranges()))}
    pieces = PieceSet()
    for relative, payload in payloads.items():
        states = payload["optimizer"]["optimizer"]["state"]
        for index, entry in enumerate(payload["shard_layout"]):
            if entry[0] != "shard" or index not in states:
                continue
            _, stage, segment, start, length, total = entry
            if (stage, segment) not in segments and any(stage == s for s, _ in segments):
                raise CheckpointError(f"{relative} holds optimizer state for stage {stage}, "
                                      f"segment {segment}, which this run does not have; it was "
                                      f"saved from another model or layout (pass --no-load-optim)")
            if (stage, segment) not in segments:
                continue  # a stage another pipeline rank hosts
            params, current_total = segments[(stage, segment)]
            if current_total != total:
                raise CheckpointError(f"stage {stage}, segment {segment} has {total} elements in "
                                      f"the checkpoint and {current_total} in this run; pass "
                                      f"--no-load-optim")
            add_flat_shard(pieces, names, (params, start, length, total), states[index], length,
                           tp_rank, tp_size)
    return pieces


def resharded_optimizer_state(own_relative: str, iteration_dir: str, metadata: dict,
                              components) -> dict:
    """This rank's optimizer state dict, filled from every saved shard of its tensor-parallel
    rank through their global keys; whole (replicated) parameters and the param groups come from
    ``own_relative`` (a shard file of this rank's pipeline position, relative to the iteration)."""
    parallel_state, optimizer = components.parallel_state, components.optimizer
    chunks = components.model_chunks
    relatives = tensor_parallel_shard_files(metadata, parallel_state.tp_rank)
    if own_relative not in relatives:
        raise CheckpointError(f"{os.path.join(iteration_dir, METADATA_FILENAME)} lists no "
                              f"{own_relative}; the checkpoint is incomplete")
    payloads = {relative: _read_shard_file(iteration_dir, metadata, relative)
                for relative in relatives}
    saved = saved_shard_pieces(payloads, optimizer, chunks, parallel_state.tp_rank,
                               parallel_state.tp_size)
    shapes = {piece.key: (piece.global_shape, piece.tensor.dtype) for piece in saved}
    states = empty_optimizer_states(optimizer, chunks, shapes)
    targets = list(optimizer_pieces(optimizer, chunks, parallel_state.tp_rank,
                                    parallel_state.tp_size, states=states))
    gaps = fill_from(targets + scalar_state_fallbacks(optimizer, chunks, states), list(saved))
    if gaps:
        raise CheckpointError(f"the saved optimizer shards of {iteration_dir} do not cover "
                              f"{'; '.join(gaps[:3])}; the checkpoint is incomplete (pass "
                              f"--no-load-optim)")
    own = payloads[own_relative]
    own_states = own["optimizer"]["optimizer"]["state"]
    replicated = {entry[1]: own_states.get(index)
                  for index, entry in enumerate(own["shard_layout"]) if entry[0] == "replicated"}
    positions = {id(param): position for position, param in enumerate(optimizer.replicated)}
    state = {}
    for index, param in enumerate(optimizer_params(optimizer)):
        if param in states:
            state[index] = states[param]
        elif replicated.get(positions.get(id(param))) is not None:
            state[index] = replicated[positions[id(param)]]
    result = {key: value for key, value in own["optimizer"].items() if key != "optimizer"}
    result["optimizer"] = {"state": state,
                           "param_groups": own["optimizer"]["optimizer"]["param_groups"]}
    return result
