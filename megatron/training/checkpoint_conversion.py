"""Convert a checkpoint's weights from one parallel layout to another (TP, PP, schedule).

One process reads every rank file of a checkpoint iteration, merges each parameter to its full
tensor and writes the weights in another layout, with Megatron's directory and file naming, so the
existing :class:`~megatron.training.checkpointing.Checkpointer` loads them in the target layout.

Merging: a tensor-parallel parameter's shards are concatenated along its ``partition_dim``; a
replicated parameter must be identical on every TP rank. A parameter held by several chunks (the two
replicas of a Chimera stage; the last stage's copy of the tied word embedding) must be identical in
every copy; otherwise :class:`ConversionError` names the parameter. Which parameters are
tensor-parallel (and along which dimension), and which parameters each target chunk holds, come from
the model itself: every distinct chunk is built once on the ``meta`` device at TP size 1 (no memory
for weights, no process groups).

The result is weights only: no optimizer, LR schedule or RNG state (Adam moments do not split the
way their parameters do under a different layout without more bookkeeping). The file says so
(``"weights_only": True``); the loader then requires ``--finetune`` or ``--no-load-optim`` and
skips the RNG states. Iteration and consumed samples are carried over.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.config import CheckpointConfig, MegatronConfig
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.planning.stage_split import config_stage_layer_ranges
from megatron.core.pipeline_parallel.planning.plan import layout_from_config
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES, ScheduleRegistry
from megatron.core.tensor_parallel.utils import shard_of
from megatron.training.checkpointing import (
    CHECKPOINT_FILENAME, CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, METADATA_FILENAME,
    CheckpointError, _read_metadata, _verify_file, checkpoint_file, describe_layout, file_crc32,
    iteration_dir_name, load_file, model_keys, parallel_layout, rank_dir_name, read_tracker,
    save_file)
from megatron.training.checkpointing import torch_dist
from megatron.training.checkpointing.global_keys import (Piece, PieceSet, TensorPlacement,
                                                        fill_from)
from megatron.training.checkpointing.files import published_iteration_dir

#: What the converter writes unless told otherwise: the training runs' default ``--ckpt-format``.
DEFAULT_CKPT_FORMAT = CheckpointConfig().ckpt_format
CKPT_FORMATS = ("torch_dist", "torch")

# Flags of the parallel layout besides the schedule families' own (see layout_fields); everything
# else of the source run's config carries over.
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_schedule",
                 "chimera_grad_sync", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")


def layout_fields(registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> tuple[str, ...]:
    """:data:`LAYOUT_FIELDS` and the config fields of every family's options and selecting flags
    (``--chimera-pipelines``, ``--num-layers-per-virtual-pipeline-stage``, ...)."""
    fields = list(LAYOUT_FIELDS)
    for family in registry.families:
        for name in [option.config_field for option in family.options] + list(family.selected_by):
            if name not in fields:
                fields.append(name)
    return tuple(fields)


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the problem and the fix."""


@dataclass(frozen=True)
class TargetLayout:
    """The parallel layout to convert to (Megatron's flag names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    pipeline_schedule: Optional[str] = None
    chimera_pipelines: int = 2
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None  # uneven stages (stage_split)
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False


@dataclass
class SourceCheckpoint:
    """Every rank file of one iteration: ``payloads[(tp_rank, pp_rank)]`` and the metadata."""

    root: str
    iteration: int
    metadata: dict
    config: MegatronConfig
    payloads: dict
    full: Optional[dict] = None   # a torch_dist checkpoint's whole tensors (no payloads)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def config_from_dict(values: dict) -> MegatronConfig:
    """Rebuild the :class:`MegatronConfig` a checkpoint stores as ``dataclasses.asdict``."""
    sections = {}
    for section_field in dataclasses.fields(MegatronConfig):
        section_class = section_field.default_factory
        known = {field.name for field in dataclasses.fields(section_class)}
        saved = values.get(section_field.name, {})
        sections[section_field.name] = section_class(
            **{name: value for name, value in saved.items() if name in known})
    return MegatronConfig(**sections)


def target_config(source: MegatronConfig, target: TargetLayout,
                  registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> MegatronConfig:
    """The source run's config with the target layout's parallel flags, validated by
    ``parse_args`` for a world of TP x PP processes (data-parallel size 1: it does not change the
    weights). Raises ConversionError when the target layout is invalid for the model."""
    # imported here: arguments imports much of the package
    from megatron.training.arguments import config_to_argv, parse_args

    config = copy.deepcopy(source)
    defaults = type(config.parallel)()
    for name in layout_fields(registry):  # start from the defaults: no source-only option lingers
        setattr(config.parallel, name, getattr(defaults, name))
    for field in dataclasses.fields(TargetLayout):
        setattr(config.parallel, field.name, getattr(target, field.name))
    for name in ("load", "save"):  # the conversion's own paths are not the training run's
        if hasattr(config.checkpoint, name):
            setattr(config.checkpoint, name, None)
    world_size = target.tensor_model_parallel_size * target.pipeline_model_parallel_size
    try:
        validated = parse_args(config_to_argv(config), world_size=world_size, registry=registry)
    except (ValueError, SystemExit) as error:
        raise ConversionError(f"the target layout [TP={target.tensor_model_parallel_size}, "
                              f"PP={target.pipeline_model_parallel_size}, schedule="
                              f"{target.pipeline_schedule or '1f1b'}] is not valid for the "
                              f"source run's flags: {error}; choose another target layout"
                              ) from None
    saved_padded = source.model.padded_vocab_size
    if validated.model.padded_vocab_size is None:  # a tokenizer's vocabulary: keep the padding
        validated.model.padded_vocab_size = saved_padded
    if validated.model.padded_vocab_size != saved_padded or \
            saved_padded % target.tensor_model_parallel_size:
        raise ConversionError(
            f"the padded vocabulary differs between layouts ({saved_padded} in the checkpoint, "
            f"{validated.model.padded_vocab_size} with TP={target.tensor_model_parallel_size}); "
            f"converting would change the embedding's shape: choose a "
            f"--make-vocab-size-divisible-by for the source run that pads equally for both TP "
            f"sizes, or another target TP size")
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "max_position_embeddings", "untie_embeddings_and_output_weights"):
        if getattr(validated.model, name) != getattr(source.model, name):
            raise ConversionError(f"model flag --{name.replace('_', '-')} changed from "
                                  f"{getattr(source.model, name)} to "
                                  f"{getattr(validated.model, name)} while converting; this is a "
                                  f"bug in the converter's flag handling")
    return validated


# ----------------------------------------------------------------------------------------------
# Which parameters each chunk holds (meta-device templates)
# ----------------------------------------------------------------------------------------------

def chunk_specs(config: MegatronConfig, registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """``{pp_rank: [(pre_process, post_process, layer_range), ...]}`` in hosted (file) order."""
    layout = layout_from_config(config, registry)
    num_stages = layout.num_stages
    stage_layers = config_stage_layer_ranges(config, num_stages)
    specs = {}
    for pp_rank in range(config.parallel.pipeline_model_parallel_size):
        specs[pp_rank] = [
            (stage == 0, stage == num_stages - 1, stage_layers[stage])
            for _, stage in layout.hosted(pp_rank)]
    return specs


def template_parameters(config: MegatronConfig, pre_process: bool, post_process: bool,
                        layer_range: range) -> dict:
    """``{name: (full shape, partition_dim or None)}`` of one chunk, from a TP-1 model built on
    the meta device (no weight memory, no process groups)."""
    from megatron.core.models.gpt.model import GPTModel  # heavy import, only when converting

    model = GPTModel(config.model, config.recompute, ParallelState.single_process(),
                     config.training.seed, layer_range=layer_range, pre_process=pre_process,
                     post_process=post_process, device=torch.device("meta"))
    result = {}
    for name, param in model.named_parameters():
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        result[name] = (tuple(param.shape), dim)
    for name, buffer in model.named_buffers():
        if name in model.state_dict():
            result[name] = (tuple(buffer.shape), None)
    return result


def _templates(config: MegatronConfig, registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """``{pp_rank: [template of each hosted chunk]}`` (each distinct chunk built once)."""
    cache, result = {}, {}
    for pp_rank, specs in chunk_specs(config, registry).items():
        result[pp_rank] = []
        for spec in specs:
            key = (spec[0], spec[1], spec[2].start, spec[2].stop)
            if key not in cache:
                cache[key] = template_parameters(config, *spec)
            result[pp_rank].append(cache[key])
    return result


# ----------------------------------------------------------------------------------------------
# Reading and merging
# ----------------------------------------------------------------------------------------------

def read_checkpoint(root: str, iteration: Optional[int] = None) -> SourceCheckpoint:
    """Read every rank file of ``iteration`` (default: the tracker's) and check its CRC-32."""
    if iteration is None:
        try:
            iteration = read_tracker(root)
        except ValueError as error:
            raise ConversionError(str(error)) from None
        if iteration is None:
            raise ConversionError(f"{root} has no latest_checkpointed_iteration.txt; pass "
                                  f"--iteration N or point --load at a checkpoint directory")
    iteration_dir = os.path.join(root, iteration_dir_name(iteration))
    if not os.path.isdir(iteration_dir):
        available = sorted(name for name in os.listdir(root) if name.startswith("iter_")) \
            if os.path.isdir(root) else []
        raise ConversionError(f"iteration {iteration} does not exist: no {iteration_dir} "
                              f"(available: {available or 'none'}); pass an existing --iteration")
    try:
        metadata = _read_metadata(os.path.join(iteration_dir, METADATA_FILENAME))
    except CheckpointError as error:
        raise ConversionError(str(error)) from None
    if torch_dist.is_torch_dist(metadata):  # global tensors: nothing to merge
        try:
            full, objects = torch_dist.read_full_weights(iteration_dir, metadata)
        except CheckpointError as error:
            raise ConversionError(str(error)) from None
        progress = objects["progress"]
        return SourceCheckpoint(root, iteration, metadata, config_from_dict(objects["config"]),
                                {(0, 0): progress}, full)
    layout = metadata["layout"]
    tp_size = layout["tensor_model_parallel_size"]
    pp_size = layout["pipeline_model_parallel_size"]
    payloads = {}
    for tp_rank in range(tp_size):
        for pp_rank in range(pp_size):
            path = checkpoint_file(root, iteration, tp_rank, pp_rank, pp_size)
            relative = os.path.relpath(path, iteration_dir)
            if relative not in metadata["files"]:
                raise ConversionError(f"{METADATA_FILENAME} of {iteration_dir} lists no "
                                      f"{relative}; the checkpoint is incomplete")
            try:
                _verify_file(path, metadata["files"][relative])
                payload = load_file(path)
            except CheckpointError as error:
                raise ConversionError(str(error)) from None
            for key in ("config", *model_keys(layout["model_chunks_per_rank"])):
                if key not in payload:
                    raise ConversionError(f"checkpoint file {path} has no {key!r} entry; it is "
                                          f"corrupt or not written by this project")
            payloads[(tp_rank, pp_rank)] = payload
    config = config_from_dict(payloads[(0, 0)]["config"])
    return SourceCheckpoint(root, iteration, metadata, config, payloads)


def merge_full_state(source: SourceCheckpoint,
                     registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """``{name: full tensor}`` of every parameter of the source checkpoint.

    Every saved tensor is a box of its global tensor (:mod:`.checkpointing.global_keys`): a
    tensor-parallel shard at ``tp_rank x local size`` along its ``partition_dim``, anything else
    the whole tensor; the boxes are assembled with ``fill_from``. Copies of a box (TP-replicated
    parameters, Chimera replicas, tied embedding copies) must be identical: ConversionError names
    the parameter otherwise.
    """
    if source.full is not None:
        return {name: value.clone() for name, value in source.full.items()}
    layout = source.metadata["layout"]
    tp_size = layout["tensor_model_parallel_size"]
    keys = model_keys(layout["model_chunks_per_rank"])
    templates = _templates(source.config, registry)
    pieces, where = PieceSet(), {}
    for pp_rank in range(layout["pipeline_model_parallel_size"]):
        if len(templates[pp_rank]) != len(keys):
            raise ConversionError(f"the checkpoint's layout [{describe_layout(layout)}] holds "
                                  f"{len(keys)} chunks per rank, but its config's schedule hosts "
                                  f"{len(templates[pp_rank])}; the checkpoint is inconsistent")
        for key, template in zip(keys, templates[pp_rank]):
            for tp_rank in range(tp_size):
                state = source.payloads[(tp_rank, pp_rank)][key]
                location = f"pipeline rank {pp_rank} {key} (TP rank {tp_rank})"
                if set(state) != set(template):
                    missing = sorted(set(template) - set(state))[:3]
                    unexpected = sorted(set(state) - set(template))[:3]
                    raise ConversionError(
                        f"{location} does not hold the parameters its layout implies (missing "
                        f"{missing}, unexpected {unexpected}); the checkpoint does not match its "
                        f"own config")
                for name, (shape, dim) in template.items():
                    _add_saved_box(pieces, where, name, shape, dim, state[name], tp_rank,
                                   tp_size, location)
    full = {piece.key: torch.empty(piece.global_shape, dtype=piece.tensor.dtype)
            for piece in pieces}
    gaps = fill_from([Piece(name, tuple(value.shape), (0,) * value.dim(), value)
                      for name, value in full.items()], list(pieces))
    if gaps:
        raise ConversionError(f"the checkpoint does not cover {'; '.join(gaps[:3])}; it is "
                              f"incomplete")
    return full


def _add_saved_box(pieces: PieceSet, where: dict, name: str, shape: tuple, dim, value,
                   tp_rank: int, tp_size: int, location: str) -> None:
    """Add one saved tensor as its box of the global tensor ``name`` (checked: its shape, and
    equality with an earlier copy of the same box)."""
    local, offsets = list(shape), [0] * len(shape)
    if dim is not None:
        local[dim] //= tp_size
        offsets[dim] = tp_rank * local[dim]
    if tuple(value.shape) != tuple(local):
        raise ConversionError(f"{name} ({location}) has shape {tuple(value.shape)}, the model "
                              f"expects {tuple(local)} per TP rank; the checkpoint does not "
                              f"match its config")
    index = (name, tuple(offsets))
    if index in pieces.by_index and not torch.equal(pieces.by_index[index].tensor, value):
        raise ConversionError(
            f"parameter {name} differs between its copies ({where[index]} and {location}): the "
            f"replicas (TP-replicated parameters, Chimera stage replicas, tied embedding copies) "
            f"must be identical; convert a checkpoint whose replicas were kept in sync")
    where.setdefault(index, location)
    pieces.add(name, TensorPlacement(tuple(shape), tuple(offsets)), value)


# ----------------------------------------------------------------------------------------------
# Splitting and writing
# ----------------------------------------------------------------------------------------------

def _check_has(full: dict, name: str, shape: tuple) -> None:
    if name not in full:
        raise ConversionError(f"the source checkpoint has no {name}, which the target layout "
                              f"needs; the model flags differ")
    if tuple(full[name].shape) != tuple(shape):
        raise ConversionError(f"{name} has shape {tuple(full[name].shape)} in the source, the "
                              f"target model expects {tuple(shape)}")


def model_state_of(full: dict, config: MegatronConfig,
                   registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """The entries of ``full`` that the model of ``config`` holds, each checked to be there with
    its full shape (ConversionError otherwise)."""
    found = {}
    for templates in _templates(config, registry).values():
        for template in templates:
            for name, (shape, _) in template.items():
                _check_has(full, name, shape)
                found[name] = full[name]
    return found


def split_for_layout(full: dict, config: MegatronConfig,
                     registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> dict:
    """``{(tp_rank, pp_rank): [state dict of each hosted chunk]}`` of the layout of ``config``."""
    tp_size = config.parallel.tensor_model_parallel_size
    result = {}
    for pp_rank, templates in _templates(config, registry).items():
        for tp_rank in range(tp_size):
            chunks = []
            for template in templates:
                state = {}
                for name, (shape, dim) in template.items():
                    _check_has(full, name, shape)
                    value = full[name]
                    if dim is not None:
                        value = shard_of(value, dim, tp_rank, tp_size)
                    state[name] = value.clone().contiguous()  # own storage: small files
                chunks.append(state)
            result[(tp_rank, pp_rank)] = chunks
    return result


def write_weights_checkpoint(root: str, iteration: int, config: MegatronConfig, chunks: dict,
                             progress: dict, note: str = "",
                             registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> str:
    """Write ``chunks`` (from :func:`split_for_layout`) as a weights-only checkpoint of the
    layout of ``config`` into ``root``: rank files, metadata with CRCs, then the tracker.
    Returns the iteration directory. Refuses to overwrite an existing iteration directory."""
    num_chunks = len(next(iter(chunks.values())))
    layout = parallel_layout(config, num_chunks, registry)
    header = {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION,
              "iteration": iteration,
              "consumed_train_samples": int(progress.get("consumed_train_samples", 0)),
              "consumed_valid_samples": int(progress.get("consumed_valid_samples", 0)),
              "layout": layout, "data_parallel_size": 1}
    pp_size = config.parallel.pipeline_model_parallel_size
    files = {}
    with published_iteration_dir(root, iteration, ConversionError) as (final_dir, staging_dir):
        for (tp_rank, pp_rank), states in sorted(chunks.items()):
            relative = os.path.join(rank_dir_name(tp_rank, pp_rank, pp_size), CHECKPOINT_FILENAME)
            payload = {**header, "config": dataclasses.asdict(config), "weights_only": True,
                       "converted_from": note, "optimizer": None, "opt_param_scheduler": None,
                       "rng_state": []}
            for key, state in zip(model_keys(num_chunks), states):
                payload[key] = state
            path = os.path.join(staging_dir, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_file(payload, path)
            files[relative] = {"size": os.path.getsize(path), "crc32": file_crc32(path)}
        with open(os.path.join(staging_dir, METADATA_FILENAME), "w") as handle:
            json.dump({**header, "weights_only": True, "files": dict(sorted(files.items()))},
                      handle, indent=2)
    return final_dir


def write_weights(save: str, iteration: int, config: MegatronConfig, full: dict, progress: dict,
                  note: str = "", ckpt_format: str = DEFAULT_CKPT_FORMAT,
                  registry: ScheduleRegistry = BUILTIN_SCHEDULES) -> tuple[str, str]:
    """Write ``full`` ({name: whole tensor}) as a weights-only checkpoint of ``config`` in
    ``ckpt_format``: "torch_dist" (the training default) writes whole tensors through
    torch.distributed.checkpoint, which load in any layout; "torch" writes the per-rank files of
    ``config``'s layout. Returns (iteration directory, what was written, for the log)."""
    if ckpt_format not in CKPT_FORMATS:
        raise ConversionError(f"unknown checkpoint format {ckpt_format!r}; choose one of "
                              f"{', '.join(CKPT_FORMATS)}")
    if ckpt_format == torch_dist.TORCH_DIST:
        state = model_state_of(full, config, registry)
        try:
            written = torch_dist.write_full_weights(save, iteration, config, state, progress,
                                                    note=note)
        except CheckpointError as error:
            raise ConversionError(str(error)) from None
        return written, "torch_dist, loads in any layout"
    chunks = split_for_layout(full, config, registry)
    written = write_weights_checkpoint(save, iteration, config, chunks, progress, note=note,
                                       registry=registry)
    layout = parallel_layout(config, len(next(iter(chunks.values()))), registry)
    return written, f"torch, {describe_layout(layout)}"


def convert_checkpoint(load: str, save: str, target: TargetLayout,
                       iteration: Optional[int] = None, log=print,
                       registry: ScheduleRegistry = BUILTIN_SCHEDULES,
                       ckpt_format: str = DEFAULT_CKPT_FORMAT) -> str:
    """Convert ``load``'s iteration (default: the tracker's) to ``target``; write it to ``save``.
    ``registry`` holds the schedule families of both layouts (pass your own for a family of
    yours).

    Either format is read. ``ckpt_format`` (default: the training default, ``torch_dist``) is what
    is written: "torch_dist" whole tensors through torch.distributed.checkpoint, which load in any
    layout (the target layout then only validates the flags); "torch" the target layout's
    per-rank files.

    Returns the written iteration directory. Raises ConversionError (a ValueError) naming the
    problem and the fix for a missing iteration, corrupt files, diverged replicas, a model that
    does not fit the target layout.
    """
    source = read_checkpoint(load, iteration)
    source_layout = describe_layout(source.metadata["layout"])
    config = target_config(source.config, target, registry)
    log(f"converting {load} iteration {source.iteration} [{source_layout}]")
    full = merge_full_state(source, registry)
    written, what = write_weights(save, source.iteration, config, full, source.payloads[(0, 0)],
                                  note=source_layout, ckpt_format=ckpt_format, registry=registry)
    log(f"  wrote {written} [{what}]: {len(full)} parameters, weights only (load it with "
        f"--finetune or --no-load-optim)")
    return written
