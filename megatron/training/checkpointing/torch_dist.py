"""``--ckpt-format torch_dist``: one checkpoint of global tensors, written by every rank in
parallel through torch.distributed.checkpoint and loadable into any parallel layout.

Layout on disk (the tracker, staging and publishing are the same as for ``--ckpt-format torch``)::

    SAVE/iter_0000100/metadata.json     format, iteration, layout, config, size + CRC-32 per file
    SAVE/iter_0000100/.metadata         DCP's index: every key, its global shape and saved boxes
    SAVE/iter_0000100/__3_0.distcp      what rank 3 wrote (one file per rank that wrote anything)

Keys (see :mod:`.global_keys`): ``model.<name>`` and ``optimizer.state.<state>.<name>`` as global
tensors; objects ``progress`` (iteration, consumed samples: the data iterator position),
``config``, ``opt_param_scheduler``, ``optimizer.grad_scaler`` (fp16), and per global rank
``rng_state.rank_NNNNN`` and ``gradient_reducer_state.rank_NNNNN`` (the gradient reducers' own
state, e.g. error-feedback buffers).

Loading reads, on every rank, the boxes of each global tensor that the rank's parameters and
optimizer shards need, whatever the saved layout (TP, PP, DP, schedule, distributed optimizer on or
off). Per-rank states (RNG, reducer state) are restored only into the same layout and world size;
otherwise a note says they start afresh (dropout here is counter-based, so it is unaffected).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.distributed.reduction import load_reducer_states, reducer_states
from megatron.training.checkpointing.collectives import (_all_gather, _raise_for_failures,
                                                        _raise_if_any_failed)
from megatron.training.checkpointing.dcp_io import (DCP_METADATA_FILENAME,
                                                   ChecksummingFileSystem, PieceLoadPlanner,
                                                   PieceSavePlanner, VerifyingReader,
                                                   single_process_dcp,
                                                   unpack_boxes)
from megatron.training.checkpointing.files import (CheckpointError, _describe, file_crc32,
                                                  weights_only_note)
from megatron.training.checkpointing.global_keys import (MODEL_PREFIX, OPTIMIZER_PREFIX,
                                                        PieceSet, TensorPlacement,
                                                        empty_optimizer_states, fill_from,
                                                        model_pieces, optimizer_params,
                                                        optimizer_pieces,
                                                        scalar_state_fallbacks)
from megatron.training.checkpointing.staging import source_signature
from megatron.training.checkpointing.state import (ARCHITECTURE_FLAGS, _check_model_flags,
                                                  _load_optimizer_state, capture_rng_state,
                                                  describe_layout, parallel_layout,
                                                  restore_rng_state, runtime_registry)

logger = logging.getLogger(__name__)

TORCH_DIST = "torch_dist"

#: Global tensors of at most this many bytes (biases, norms, Adam's step counts: most keys of a
#: model, few of its bytes) are not written as DCP items of their own: each rank saves its boxes of
#: them as ONE object, ``packed_tensors.rank_NNNNN`` (one buffer per dtype and an index,
#: :func:`.dcp_io.pack_boxes`); DCP pays about a millisecond per item it writes. Loading reads
#: every rank's packed object and fills this rank's boxes from them
#: (:func:`.global_keys.fill_from`).
PACK_LIMIT_BYTES = 1 << 20
PACKED = "packed_tensors"


def describe_failure(caught: BaseException) -> str:
    """One line per failing rank of a DCP collective (its exception wraps every rank's), else the
    exception itself; a CheckpointError's message is kept as it is (it names the file)."""
    if isinstance(caught, CheckpointException):
        return "; ".join(f"rank {rank}: {describe_failure(error)}"
                         for rank, (error, _) in sorted(caught.failures.items()))
    return str(caught) if isinstance(caught, CheckpointError) else _describe(caught)


def rank_key(what: str, rank: int) -> str:
    """``rng_state.rank_00003``: a per-rank object."""
    return f"{what}.rank_{rank:05d}"


def _no_dist(parallel_state) -> bool:
    return not (parallel_state.world_size > 1 and dist.is_available() and dist.is_initialized())


def run_layout(components) -> dict:
    """The layout that per-rank states (RNG, reducer state) depend on."""
    return {**parallel_layout(components.config, len(components.model_chunks),
                              runtime_registry(components)),
            "data_parallel_size": components.parallel_state.dp_size,
            "world_size": components.parallel_state.world_size}


def metadata_fields(components, checkpoint_config) -> dict:
    """What ``metadata.json`` of a torch_dist checkpoint records besides the common header."""
    model = dataclasses.asdict(components.config.model)
    return {"ckpt_format": TORCH_DIST, "run_layout": run_layout(components),
            "model": {name: model[name] for name in ARCHITECTURE_FLAGS if name in model},
            "optimizer_saved": not checkpoint_config.no_save_optim,
            "rng_saved": not checkpoint_config.no_save_rng}


# ----------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------

def snapshot(components, state, checkpoint_config, *, copy: bool, staging=None,
             config_dict=None, packed_here=None):
    """(pieces, objects) of this rank; ``copy`` clones every tensor (for a background save, so
    training may change the weights meanwhile), into ``staging``'s reused buffers when given
    (:class:`.staging.StagingBuffers`, which also keeps the pieces from save to save while their
    sources are the same tensors; ``packed_here``: the small pieces this rank packs, see there).
    ``config_dict``: ``dataclasses.asdict`` of the config, when the caller keeps it from save to
    save."""
    parallel_state = components.parallel_state
    tp_rank, tp_size = parallel_state.tp_rank, parallel_state.tp_size
    chunks = components.model_chunks
    model_states = [chunk.state_dict() for chunk in chunks]
    with_optimizer = not checkpoint_config.no_save_optim
    pieces, signature = None, None
    if copy and staging is not None:
        optimizer_states = None
        if with_optimizer:
            states = components.optimizer.optimizer.state
            optimizer_states = [states.get(param)
                                for param in optimizer_params(components.optimizer)]
        signature = source_signature(model_states, optimizer_states)
        pieces = staging.restage(signature, packed_here)
    if pieces is None:
        pieces = list(model_pieces(chunks, model_states, tp_rank, tp_size))
        if with_optimizer:
            pieces += list(optimizer_pieces(components.optimizer, chunks, tp_rank, tp_size))
        if copy and staging is not None:
            staging.stage(pieces, lambda piece: is_packed(piece.global_shape, piece.tensor.dtype),
                          packed_here, signature)
        elif copy:
            for piece in pieces:
                piece.tensor = piece.tensor.detach().to("cpu", copy=True)
        else:
            for piece in pieces:
                if piece.tensor.device.type != "cpu":
                    piece.tensor = piece.tensor.detach().cpu()
    objects = {"progress": {"iteration": int(state.iteration),
                            "consumed_train_samples": int(state.consumed_train_samples),
                            "consumed_valid_samples": int(state.consumed_valid_samples)},
               "config": config_dict if config_dict is not None
               else dataclasses.asdict(components.config)}
    if with_optimizer:
        objects["opt_param_scheduler"] = components.lr_scheduler.state_dict()
        if components.optimizer.grad_scaler is not None:
            objects["optimizer.grad_scaler"] = components.optimizer.grad_scaler.state_dict()
        reducer_state = reducer_states(components.gradient_reducers)
        if reducer_state is not None:
            objects[rank_key("gradient_reducer_state", parallel_state.rank)] = reducer_state
    if not checkpoint_config.no_save_rng:
        objects[rank_key("rng_state", parallel_state.rank)] = capture_rng_state()
    if state.rerun_state is not None:  # the re-run engine's exit 16 (megatron.training.rerun)
        objects[rank_key("rerun_state", parallel_state.rank)] = dict(state.rerun_state)
    return pieces, objects


def collect(components, state, checkpoint_config, copy: bool, **snapshot_options) -> tuple:
    """(pieces, objects, error) of this rank: its :func:`snapshot`, or why it could not take it
    (then every rank's DCP save fails with it: :func:`planner_for`)."""
    try:
        pieces, objects = snapshot(components, state, checkpoint_config, copy=copy,
                                   **snapshot_options)
    except Exception as caught:
        return [], {}, f"collecting its checkpoint state: {_describe(caught)}"
    return pieces, objects, None


def planner_for(parallel_state, pieces, objects: dict, error=None, serialized=None,
                split=None, packed_objects=None) -> PieceSavePlanner:
    """The DCP planner of this rank's save: small tensors packed (see :data:`PACK_LIMIT_BYTES`;
    DCP's global planning picks the rank that packs a box several ranks hold), the others DCP
    items. ``error``: this rank cannot save, and every rank's DCP save fails naming it.
    ``serialized``: ``{key: bytes}`` of objects already ``torch.save``-d. ``split``:
    :func:`split_packed` of ``pieces`` (or the same as dicts by index), when the caller keeps
    it; ``packed_objects``: see :class:`.dcp_io.PieceSavePlanner`."""
    packed, unpacked = split_packed(pieces) if split is None else split
    return PieceSavePlanner(unpacked, objects, packed=packed,
                            packed_key=rank_key(PACKED, parallel_state.rank), error=error,
                            serialized=serialized, packed_objects=packed_objects)


def split_packed(pieces) -> tuple[list, list]:
    """(packed, unpacked) pieces: see :data:`PACK_LIMIT_BYTES`."""
    packed, unpacked = [], []
    for piece in pieces:
        (packed if is_packed(piece.global_shape, piece.tensor.dtype) else unpacked).append(piece)
    return packed, unpacked


def is_packed(global_shape, dtype) -> bool:
    """Whether a global tensor is small enough to travel in its ranks' packed object."""
    return math.prod(global_shape) * dtype.itemsize <= PACK_LIMIT_BYTES


def writer_for(staging_dir: str) -> FileSystemWriter:
    """One file per rank, fsynced (the staging directory is renamed only after all are); each
    file's size and CRC-32 recorded as it is written (:class:`.dcp_io.ChecksummingFileSystem`,
    read by :func:`own_files`)."""
    writer = FileSystemWriter(staging_dir, single_file_per_rank=True, sync_files=True,
                              thread_count=1)
    writer.fs = ChecksummingFileSystem()
    return writer


def own_files(staging_dir: str, rank: int, with_dcp_metadata: bool = True,
              writer: Optional[FileSystemWriter] = None) -> dict:
    """``{relative path: {size, crc32}}`` of the files this rank's DCP writer produced (rank 0
    also records DCP's ``.metadata`` unless ``with_dcp_metadata`` is False: not written yet).
    ``writer``: the writer of this save (:func:`writer_for`), whose records of the files it
    wrote are used instead of reading them back."""
    found = sorted(glob.glob(os.path.join(staging_dir, own_file_pattern(rank))))
    if rank == 0 and with_dcp_metadata:
        found.append(os.path.join(staging_dir, DCP_METADATA_FILENAME))
    written = getattr(getattr(writer, "fs", None), "written", {})
    return {os.path.relpath(path, staging_dir):
            written.get(os.path.normpath(path)) or file_record(path) for path in found}


def own_file_pattern(rank: int) -> str:
    """The names of the files rank ``rank``'s DCP writer produces (one per rank, see
    :func:`writer_for`)."""
    return f"__{rank}_*.distcp"


def file_record(path: str) -> dict:
    """What ``metadata.json`` records of one file: its size and CRC-32."""
    return {"size": os.path.getsize(path), "crc32": file_crc32(path)}


def write_pieces(components, pieces, objects, staging_dir: str, error=None) -> None:
    """The collective DCP save of every rank's pieces (raises on every rank if one failed, or
    if one arrived with an ``error``)."""
    with single_process_dcp():
        dcp.save({}, storage_writer=writer_for(staging_dir),
                 planner=planner_for(components.parallel_state, pieces, objects, error),
                 no_dist=_no_dist(components.parallel_state))


def save_files(components, state, checkpoint_config, root: str, staging_dir: str) -> dict:
    """Write this checkpoint into ``staging_dir`` on every rank; returns every rank's files.

    Every rank enters DCP's save, also one that could not collect its state (its planning fails,
    so DCP's own agreement fails the save on every rank instead of leaving its peers waiting);
    then every rank records its files' CRC-32s; a failure anywhere raises on every rank, the
    caller removes the staging directory."""
    parallel_state = components.parallel_state
    pieces, objects, error = collect(components, state, checkpoint_config, copy=False)
    files = {}
    try:
        write_pieces(components, pieces, objects, staging_dir, error)
        files = own_files(staging_dir, parallel_state.rank)
    except (Exception, CheckpointException) as caught:
        error = describe_failure(caught)
    return collect_files(parallel_state, error, files, state.iteration, root)


def collect_files(parallel_state, error, files: dict, iteration: int, root: str) -> dict:
    """Every rank's files (after every rank's write finished); raises everywhere on a failure."""
    gathered = _all_gather(parallel_state, (error, files))
    _raise_for_failures([message for message, _ in gathered],
                        f"saving checkpoint at iteration {iteration} to {root} (the previous "
                        f"checkpoint and the tracker are unchanged)")
    return {name: record for _, entries in gathered for name, record in entries.items()}


# ----------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------

def _saved_tensors(dcp_metadata) -> dict:
    """``{key: (global shape, dtype)}`` of every tensor of a DCP checkpoint."""
    return {key: (tuple(entry.size), entry.properties.dtype)
            for key, entry in dcp_metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)}


def read_packed(iteration_dir: str, files: dict, dcp_metadata) -> PieceSet:
    """Every rank's packed small tensors (see :data:`PACK_LIMIT_BYTES`) as pieces, read in this
    process alone (identical boxes of several ranks, e.g. Chimera's stage replicas, kept once)."""
    keys = sorted(key for key, entry in dcp_metadata.state_dict_metadata.items()
                  if key.startswith(PACKED + ".") and not isinstance(entry, TensorStorageMetadata))
    pieces = PieceSet()
    if not keys:
        return pieces
    planner = PieceLoadPlanner([], keys)
    try:
        with single_process_dcp():
            dcp.load({}, storage_reader=VerifyingReader(iteration_dir, files), planner=planner,
                     no_dist=True)
    except CheckpointException as caught:  # not an Exception: named here, raised as ours
        raise CheckpointError(describe_failure(caught)) from None
    for key in keys:
        for name, shape, offsets, tensor in unpack_boxes(planner.objects[key]):
            pieces.add(name, TensorPlacement(tuple(shape), tuple(offsets)), tensor)
    return pieces


def _saved_with_packed(dcp_metadata, packed: PieceSet) -> dict:
    """``{key: (global shape, dtype)}`` of every tensor, DCP items and packed ones."""
    saved = _saved_tensors(dcp_metadata)
    saved.update({piece.key: (tuple(piece.global_shape), piece.tensor.dtype) for piece in packed})
    return saved


def _fill_packed(targets: list, packed: PieceSet, iteration_dir: str) -> None:
    gaps = fill_from(targets, list(packed))
    if gaps:
        raise CheckpointError(f"checkpoint {iteration_dir}: its packed tensors do not cover "
                              f"{'; '.join(gaps[:3])}; the checkpoint is incomplete")


def _check_pieces(pieces, saved: dict, iteration_dir: str) -> None:
    """Every key this rank reads exists with this run's global shape (named otherwise)."""
    for piece in pieces:
        if piece.key not in saved:
            raise CheckpointError(f"checkpoint {iteration_dir} holds no {piece.key!r} (global "
                                  f"shape {piece.global_shape}); it was saved from another model")
        if tuple(saved[piece.key][0]) != tuple(piece.global_shape):
            raise CheckpointError(f"checkpoint {iteration_dir}: {piece.key} has global shape "
                                  f"{tuple(saved[piece.key][0])}, this run's model "
                                  f"{tuple(piece.global_shape)}; the model flags differ from "
                                  f"the saved run's")


@dataclasses.dataclass
class LoadRequest:
    """What this rank reads: pieces, object keys, and where the pieces go afterwards."""

    pieces: list
    object_keys: list
    model_states: list
    optimizer_states: dict
    same_layout: bool
    packed_targets: list = dataclasses.field(default_factory=list)
    packed: PieceSet = dataclasses.field(default_factory=PieceSet)


def plan_load(components, checkpoint_config, metadata: dict, dcp_metadata,
              iteration_dir: str) -> LoadRequest:
    """Check the checkpoint against this run and decide what to read (no state changes)."""
    parallel_state = components.parallel_state
    tp_rank, tp_size = parallel_state.tp_rank, parallel_state.tp_size
    _check_model_flags(os.path.join(iteration_dir, "metadata.json"), metadata.get("model", {}),
                       dataclasses.asdict(components.config.model))
    packed = read_packed(iteration_dir, metadata["files"], dcp_metadata)
    saved_objects = set(dcp_metadata.state_dict_metadata) - set(_saved_tensors(dcp_metadata))
    saved = _saved_with_packed(dcp_metadata, packed)
    chunks = components.model_chunks
    model_states = [{name: torch.empty_like(value, device="cpu")
                     for name, value in chunk.state_dict().items()} for chunk in chunks]
    pieces = list(model_pieces(chunks, model_states, tp_rank, tp_size))
    _check_pieces(pieces, saved, iteration_dir)
    object_keys = ["progress"]
    optimizer_states = {}
    load_optimizer = not (checkpoint_config.finetune or checkpoint_config.no_load_optim)
    if load_optimizer and metadata.get("weights_only"):
        raise CheckpointError(f"checkpoint {iteration_dir} holds weights only (written by "
                              f"tools/convert_checkpoint.py): it has no optimizer state; pass "
                              f"--finetune or --no-load-optim")
    if load_optimizer and not metadata.get("optimizer_saved", True):
        raise CheckpointError(f"checkpoint {iteration_dir} holds no optimizer state (it was "
                              f"saved with --no-save-optim), so the optimizer and learning-rate "
                              f"schedule cannot be restored; pass --no-load-optim to start them "
                              f"afresh, or --finetune to load the weights only")
    load_rng = not (checkpoint_config.finetune or checkpoint_config.no_load_rng
                    or metadata.get("weights_only"))
    if load_rng and not metadata.get("rng_saved", True):
        raise CheckpointError(f"checkpoint {iteration_dir} holds no RNG state (it was saved with "
                              f"--no-save-rng); pass --no-load-rng to continue with the random "
                              f"generators as seeded by --seed")
    same_layout = metadata.get("run_layout") == run_layout(components)
    if load_optimizer:
        optimizer = components.optimizer
        optimizer_keys = {key: value for key, value in saved.items()
                          if key.startswith(OPTIMIZER_PREFIX)}
        optimizer_states = empty_optimizer_states(optimizer, chunks, optimizer_keys)
        optimizer_set = optimizer_pieces(optimizer, chunks, tp_rank, tp_size,
                                         states=optimizer_states)
        optimizer_list = list(optimizer_set) + scalar_state_fallbacks(optimizer, chunks,
                                                                      optimizer_states)
        _check_pieces(optimizer_list, saved, iteration_dir)
        pieces += optimizer_list
        object_keys.append("opt_param_scheduler")
        if optimizer.grad_scaler is not None and "optimizer.grad_scaler" in saved_objects:
            object_keys.append("optimizer.grad_scaler")
        reducer_key = rank_key("gradient_reducer_state", parallel_state.rank)
        if same_layout and reducer_key in saved_objects:
            object_keys.append(reducer_key)
    if load_rng and same_layout:
        object_keys.append(rank_key("rng_state", parallel_state.rank))
    rerun_key = rank_key("rerun_state", parallel_state.rank)
    if same_layout and not checkpoint_config.finetune and rerun_key in saved_objects:
        object_keys.append(rerun_key)
    missing = [key for key in object_keys if key not in saved_objects]
    if missing:
        raise CheckpointError(f"checkpoint {iteration_dir} holds no {missing}; it is incomplete "
                              f"or was not written by this project")
    packed_keys = {piece.key for piece in packed}
    return LoadRequest([piece for piece in pieces if piece.key not in packed_keys], object_keys,
                       model_states, optimizer_states, same_layout,
                       [piece for piece in pieces if piece.key in packed_keys], packed)


def read(components, request: LoadRequest, iteration_dir: str, files: dict) -> dict:
    """The collective DCP load of every rank's request; returns the objects read."""
    planner = PieceLoadPlanner(request.pieces, request.object_keys)
    with single_process_dcp():
        dcp.load({}, storage_reader=VerifyingReader(iteration_dir, files), planner=planner,
                 no_dist=_no_dist(components.parallel_state))
    planner.fill_copies()
    _fill_packed(request.packed_targets, request.packed, iteration_dir)
    return planner.objects


def optimizer_state_dict(optimizer, states: dict, grad_scaler=None) -> dict:
    """A MegatronOptimizer state dict holding ``states`` ({parameter: state}) and ``grad_scaler``
    (if any); the param groups are this run's (their settings come from the current flags)."""
    torch_state = optimizer.optimizer.state_dict()
    torch_state["state"] = {index: states[param]
                            for index, param in enumerate(optimizer_params(optimizer))
                            if param in states}
    state = {"optimizer": torch_state}
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler
    return state


def apply(components, checkpoint_config, request: LoadRequest, objects: dict, log,
          training_state_class):
    """Copy what was read into the model, optimizer, schedule, RNG; return the TrainingState."""
    parallel_state = components.parallel_state
    for chunk, state in zip(components.model_chunks, request.model_states):
        chunk.load_state_dict(state, strict=True)
    if checkpoint_config.finetune:
        return training_state_class()
    if not checkpoint_config.no_load_optim:
        optimizer = components.optimizer
        _load_optimizer_state(optimizer, optimizer_state_dict(
            optimizer, request.optimizer_states, objects.get("optimizer.grad_scaler")))
        differences = components.lr_scheduler.load_state_dict(
            objects["opt_param_scheduler"],
            use_checkpoint_values=checkpoint_config.use_checkpoint_opt_param_scheduler)
        if differences and parallel_state.rank == 0 and \
                not checkpoint_config.override_opt_param_scheduler:
            log("  learning-rate schedule of the checkpoint differs from the flags: "
                + "; ".join(differences))
        reducer_key = rank_key("gradient_reducer_state", parallel_state.rank)
        if reducer_key in objects:
            load_reducer_states(components.gradient_reducers, [objects[reducer_key]], 0)
    rng_key = rank_key("rng_state", parallel_state.rank)
    if rng_key in objects:
        restore_rng_state(objects[rng_key])
    elif not request.same_layout and parallel_state.rank == 0:
        log("  the checkpoint was saved in another layout or world size: weights and optimizer "
            "state are resharded; per-rank RNG states and gradient-reducer states (error "
            "feedback) start afresh")
    progress = objects["progress"]
    return training_state_class(
        iteration=int(progress["iteration"]),
        consumed_train_samples=int(progress["consumed_train_samples"]),
        consumed_valid_samples=int(progress["consumed_valid_samples"]),
        rerun_state=objects.get(rank_key("rerun_state", parallel_state.rank)))


def load(components, checkpoint_config, iteration_dir: str, metadata: dict, log,
         training_state_class):
    """Check, read and apply a torch_dist checkpoint (collective; raises on every rank if any
    rank failed, before anything is applied)."""
    parallel_state = components.parallel_state
    where = f"loading checkpoint {iteration_dir}"
    request, error = None, None
    try:
        reader = VerifyingReader(iteration_dir, metadata["files"])
        request = plan_load(components, checkpoint_config, metadata, reader.read_metadata(),
                            iteration_dir)
        if parallel_state.rank == 0 and metadata.get("run_layout") and not request.same_layout:
            log(f"  resharding from [{describe_layout(metadata['layout'])}, DP="
                f"{metadata['run_layout'].get('data_parallel_size')}] to "
                f"[{describe_layout(run_layout(components))}, DP={parallel_state.dp_size}]")
    except Exception as caught:
        error = describe_failure(caught)
    _raise_if_any_failed(parallel_state, error, where)
    objects, error = None, None
    try:
        objects = read(components, request, iteration_dir, metadata["files"])
    except (Exception, CheckpointException) as caught:
        error = describe_failure(caught)
    _raise_if_any_failed(parallel_state, error, where)
    result, error = None, None
    try:
        result = apply(components, checkpoint_config, request, objects, log,
                       training_state_class)
    except Exception as caught:
        error = _describe(caught)
    _raise_if_any_failed(parallel_state, error, f"restoring checkpoint {iteration_dir}")
    if metadata.get("weights_only") and parallel_state.rank == 0:
        log(weights_only_note(metadata.get("converted_from")))
    return result


def is_torch_dist(metadata: dict) -> bool:
    return metadata.get("ckpt_format") == TORCH_DIST


__all__ = ["TORCH_DIST", "is_torch_dist", "load", "metadata_fields", "save_files", "snapshot",
           "MODEL_PREFIX", "PieceSet"]


# ----------------------------------------------------------------------------------------------
# One process: whole tensors (tools/convert_checkpoint.py, Hugging Face export)
# ----------------------------------------------------------------------------------------------

def read_full_weights(iteration_dir: str, metadata: dict) -> tuple[dict, dict]:
    """``({parameter name: whole tensor}, {"config": ..., "progress": ...})`` of a torch_dist
    checkpoint, read in this one process (files verified against ``metadata.json``)."""
    from megatron.training.checkpointing.global_keys import Piece

    reader = VerifyingReader(iteration_dir, metadata["files"])
    dcp_metadata = reader.read_metadata()
    try:
        packed = read_packed(iteration_dir, metadata["files"], dcp_metadata)
        saved = _saved_with_packed(dcp_metadata, packed)
        pieces = [Piece(key, shape, (0,) * len(shape), torch.empty(shape, dtype=dtype))
                  for key, (shape, dtype) in saved.items() if key.startswith(MODEL_PREFIX)]
        packed_keys = {piece.key for piece in packed}
        planner = PieceLoadPlanner([piece for piece in pieces if piece.key not in packed_keys],
                                   ["config", "progress"])
        with single_process_dcp():
            dcp.load({}, storage_reader=VerifyingReader(iteration_dir, metadata["files"]),
                     planner=planner, no_dist=True)
    except CheckpointException as caught:
        raise CheckpointError(describe_failure(caught)) from None
    _fill_packed([piece for piece in pieces if piece.key in packed_keys], packed, iteration_dir)
    return ({piece.key[len(MODEL_PREFIX):]: piece.tensor for piece in pieces},
            planner.objects)


def write_full_weights(root: str, iteration: int, config, full: dict, progress: dict,
                       note: str = "") -> str:
    """Write ``full`` ({name: whole tensor}) as a weights-only torch_dist checkpoint (loads in any
    layout with --finetune or --no-load-optim): staging directory, metadata with CRC-32s, rename,
    then the tracker. Refuses to overwrite an existing iteration directory."""
    import json

    from megatron.training.checkpointing.files import (CHECKPOINT_FORMAT,
                                                      CHECKPOINT_FORMAT_VERSION, METADATA_FILENAME,
                                                      published_iteration_dir)
    from megatron.training.checkpointing.global_keys import Piece, model_key

    progress = {"iteration": iteration,
                "consumed_train_samples": int(progress.get("consumed_train_samples", 0)),
                "consumed_valid_samples": int(progress.get("consumed_valid_samples", 0))}
    pieces = [Piece(model_key(name), tuple(value.shape), (0,) * value.dim(),
                    value.detach().contiguous()) for name, value in sorted(full.items())]
    with published_iteration_dir(root, iteration, CheckpointError) as (final_dir, staging_dir):
        with single_process_dcp():
            dcp.save({}, storage_writer=writer_for(staging_dir),
                     planner=PieceSavePlanner(pieces, {"progress": progress,
                                                       "config": dataclasses.asdict(config)}),
                     no_dist=True)
        model = dataclasses.asdict(config.model)
        metadata = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION,
                    **progress, "layout": parallel_layout(config, 1), "data_parallel_size": 1,
                    "ckpt_format": TORCH_DIST, "weights_only": True, "converted_from": note,
                    "model": {name: model[name] for name in ARCHITECTURE_FLAGS if name in model},
                    "optimizer_saved": False, "rng_saved": False,
                    "files": own_files(staging_dir, 0)}
        with open(os.path.join(staging_dir, METADATA_FILENAME), "w") as handle:
            json.dump(metadata, handle, indent=2)
    return final_dir
