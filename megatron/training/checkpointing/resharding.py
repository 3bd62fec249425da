"""A legacy (``--ckpt-format torch``) checkpoint read into another layout — another tensor or
pipeline layout or schedule, or another data-parallel size of the distributed optimizer — with
its optimizer state: key mapping only.

Every saved file becomes pieces of global tensors (:mod:`.global_keys`), and this rank's weights
and optimizer state are filled from them with :func:`~.global_keys.fill_from`, as a torch_dist
checkpoint is read:

- a rank file's chunk state dicts (``model``, ``model0``, ...) are ``model.<name>`` boxes at the
  file's tensor-parallel offset (this run's parameters say which are split, and along which
  dimension: that does not depend on the layout);
- the optimizer state of a rank file (replicated optimizer) or of a ``distrib_optim_dpNNN.pt`` shard
  file is mapped by the ``state_keys`` recorded next to it
  (:func:`~.global_keys.optimizer_state_keys`: each position's parameter name, or a shard's flat
  range over its segment's named parameters).

Each rank reads every file of the iteration, one at a time, and keeps only the boxes of the
parameters it holds. Per-rank states (RNG, gradient-reducer state) stay behind: they belong to the
saved layout (a line says so).
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from megatron.training.checkpointing.files import (CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION,
                                                  CheckpointError, _verify_file, load_file,
                                                  model_keys)
from megatron.training.checkpointing.global_keys import (OPTIMIZER_PREFIX, PieceSet,
                                                        add_saved_optimizer_state,
                                                        empty_optimizer_states, fill_from,
                                                        model_key, model_pieces, optimizer_pieces,
                                                        partition_dim_of,
                                                        scalar_state_fallbacks, tp_placement)
from megatron.training.checkpointing.state import _check_model_flags, describe_layout
from megatron.training.checkpointing.torch_dist import (_check_pieces,
                                                        optimizer_state_dict)

_SAVED_FILE = re.compile(r"^mp_rank_(\d+)(?:_\d+)?/(model_optim_rng|distrib_optim_dp\d+)\.pt$")


def _saved_files(metadata: dict) -> list[tuple[str, int, bool]]:
    """``(relative path, tensor-parallel rank, is a rank file)`` of every file of the iteration."""
    found = []
    for relative in sorted(metadata["files"]):
        match = _SAVED_FILE.match(relative.replace(os.sep, "/"))
        if match:
            found.append((relative, int(match.group(1)), match.group(2) == "model_optim_rng"))
    return found


def _read(iteration_dir: str, metadata: dict, relative: str) -> dict:
    path = os.path.join(iteration_dir, relative)
    _verify_file(path, metadata["files"][relative])
    payload = load_file(path)
    if payload.get("format") != CHECKPOINT_FORMAT or \
            payload.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint file {path} has format {payload.get('format')!r} "
                              f"version {payload.get('format_version')}; this build reads "
                              f"{CHECKPOINT_FORMAT!r} version {CHECKPOINT_FORMAT_VERSION}")
    return payload


def _state_keys(path: str, entry: dict) -> list:
    if "state_keys" not in entry:
        raise CheckpointError(f"checkpoint file {path} predates optimizer state recorded by "
                              f"parameter name, so it cannot be resharded: resume once in its "
                              f"saved layout and data-parallel size (that run saves torch_dist, "
                              f"which loads in any layout), or pass --no-load-optim")
    return entry["state_keys"]


def _partition_dims(model_chunks) -> dict:
    """``{name: partition dim or None}`` of every entry of this rank's chunk state dicts."""
    dims = {}
    for chunk in model_chunks:
        params = dict(chunk.named_parameters())
        for name in chunk.state_dict():
            dims[name] = partition_dim_of(params.get(name))
    return dims


class SavedPieces:
    """The saved files' boxes of the parameters this rank holds, and what else loading needs
    from them (the first rank file, the loss scaler's state)."""

    def __init__(self, components, iteration_dir: str, metadata: dict, *, load_model: bool,
                 load_optimizer: bool):
        self.pieces = PieceSet()
        self.first = None
        self.grad_scaler = None
        dims = _partition_dims(components.model_chunks)
        tp_size = metadata["layout"]["tensor_model_parallel_size"]
        chunk_keys = model_keys(metadata["layout"]["model_chunks_per_rank"])
        files = _saved_files(metadata)
        if not any(is_rank_file for _, _, is_rank_file in files):
            raise CheckpointError(f"{iteration_dir}/metadata.json lists no rank file; the "
                                  f"checkpoint is incomplete")
        for relative, tp_rank, is_rank_file in files:
            if not (is_rank_file or load_optimizer):
                continue
            payload = _read(iteration_dir, metadata, relative)
            path = os.path.join(iteration_dir, relative)
            if is_rank_file:
                if self.first is None:
                    self.first = payload
                    _check_model_flags(path, payload.get("config", {}).get("model", {}),
                                       dataclasses.asdict(components.config.model))
                if load_model:
                    self._add_model(path, payload, chunk_keys, dims, tp_rank, tp_size)
                entry = payload.get("optimizer")
                if not load_optimizer or entry is None or entry.get("sharded"):
                    continue  # the distributed optimizer's state is in the shard files
            else:
                entry = payload["optimizer"]
            add_saved_optimizer_state(self.pieces, entry["optimizer"]["state"],
                                      _state_keys(path, entry), tp_rank, tp_size,
                                      wanted=dims.__contains__)
            if self.grad_scaler is None:
                self.grad_scaler = entry.get("grad_scaler")

    def _add_model(self, path: str, payload: dict, chunk_keys: list, dims: dict, tp_rank: int,
                   tp_size: int) -> None:
        for key in chunk_keys:
            if key not in payload:
                raise CheckpointError(f"checkpoint file {path} has no {key!r} entry; it was not "
                                      f"written by this project's checkpointing")
            for name, value in payload[key].items():
                if name not in dims:
                    continue
                place = tp_placement(tuple(value.shape), dims[name], tp_rank, tp_size)
                copy = self.pieces.by_index.get((model_key(name), place.offsets))
                if copy is not None and not torch.equal(copy.tensor, value):
                    raise CheckpointError(
                        f"parameter {name} differs between its copies in checkpoint "
                        f"{os.path.dirname(os.path.dirname(path))} ({path} and an earlier file): "
                        f"the replicas (Chimera stage replicas, tied embedding copies, "
                        f"tensor-parallel replicas) must be identical to be read in another "
                        f"layout; resume in the saved layout instead")
                self.pieces.add(model_key(name), place, value)

    def shapes(self) -> dict:
        """``{key: (global shape, dtype)}`` of every saved key this rank may read."""
        return {piece.key: (piece.global_shape, piece.tensor.dtype) for piece in self.pieces}


def _fill(targets: list, saved: SavedPieces, iteration_dir: str) -> None:
    """Fill ``targets`` from the saved pieces; a key missing, of another global shape, or not
    covered completely is named."""
    _check_pieces(targets, saved.shapes(), iteration_dir)
    gaps = fill_from(targets, list(saved.pieces))
    if gaps:
        raise CheckpointError(f"the saved files of {iteration_dir} do not cover "
                              f"{'; '.join(gaps[:3])}; the checkpoint is incomplete")


def _optimizer_targets(components, saved: SavedPieces) -> tuple[list, dict]:
    optimizer, chunks = components.optimizer, components.model_chunks
    parallel_state = components.parallel_state
    saved_keys = {key: value for key, value in saved.shapes().items()
                  if key.startswith(OPTIMIZER_PREFIX)}
    states = empty_optimizer_states(optimizer, chunks, saved_keys)
    targets = list(optimizer_pieces(optimizer, chunks, parallel_state.tp_rank,
                                    parallel_state.tp_size, states=states))
    return targets + scalar_state_fallbacks(optimizer, chunks, states), states


def resharded_optimizer_state(components, iteration_dir: str, metadata: dict) -> dict:
    """This rank's optimizer state from every saved optimizer state of the iteration, through
    their global keys (the distributed optimizer at another data-parallel size)."""
    saved = SavedPieces(components, iteration_dir, metadata, load_model=False,
                        load_optimizer=True)
    targets, states = _optimizer_targets(components, saved)
    _fill(targets, saved, iteration_dir)
    return optimizer_state_dict(components.optimizer, states, saved.grad_scaler)


def read_in_another_layout(components, checkpoint_config, iteration_dir: str, metadata: dict,
                           current_layout: dict) -> dict:
    """This rank's payload (as a rank file of this layout would hold it, for
    :meth:`~.checkpointer.Checkpointer._apply`) from a checkpoint of another tensor/pipeline
    layout or schedule: weights and, unless ``--finetune`` / ``--no-load-optim``, the optimizer
    state and LR schedule; no RNG or gradient-reducer state (``"resharded"`` says so)."""
    load_optimizer = not (checkpoint_config.finetune or checkpoint_config.no_load_optim)
    saved = SavedPieces(components, iteration_dir, metadata, load_model=True,
                        load_optimizer=load_optimizer)
    first = saved.first
    if load_optimizer and first.get("weights_only"):
        raise CheckpointError(f"checkpoint {iteration_dir} holds weights only (converted from "
                              f"another parallel layout by tools/convert_checkpoint.py): it has "
                              f"no optimizer state; pass --finetune or --no-load-optim")
    if load_optimizer and first.get("optimizer") is None:
        raise CheckpointError(f"checkpoint {iteration_dir} holds no optimizer state (it was "
                              f"saved with --no-save-optim), so the optimizer and learning-rate "
                              f"schedule cannot be restored; pass --no-load-optim to start them "
                              f"afresh, or --finetune to load the weights only")
    chunks = components.model_chunks
    parallel_state = components.parallel_state
    model_states = [{name: torch.empty_like(value, device="cpu")
                     for name, value in chunk.state_dict().items()} for chunk in chunks]
    targets = list(model_pieces(chunks, model_states, parallel_state.tp_rank,
                                parallel_state.tp_size))
    payload = {key: first[key] for key in ("format", "format_version", "iteration",
                                           "consumed_train_samples", "consumed_valid_samples",
                                           "weights_only", "converted_from") if key in first}
    payload.update({"layout": current_layout, "optimizer": None, "opt_param_scheduler": None,
                    "rng_state": None})
    if load_optimizer:
        optimizer_targets, states = _optimizer_targets(components, saved)
        targets += optimizer_targets
    _fill(targets, saved, iteration_dir)
    if load_optimizer:
        payload["optimizer"] = optimizer_state_dict(components.optimizer, states,
                                                   saved.grad_scaler)
        payload["opt_param_scheduler"] = first["opt_param_scheduler"]
    for key, state in zip(model_keys(len(chunks)), model_states):
        payload[key] = state
    payload["resharded"] = (f"  resharding from [{describe_layout(metadata['layout'])}] to "
                            f"[{describe_layout(current_layout)}] through global keys (weights"
                            f"{' and optimizer state' if load_optimizer else ''}); per-rank RNG "
                            f"states and gradient-reducer states (error feedback) start afresh")
    return payload
