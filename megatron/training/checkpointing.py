"""Megatron-style checkpoints: save, load and exact resume of a training run.

Layout on disk (Megatron-LM's, shared by every rank of the job)::

    SAVE/latest_checkpointed_iteration.txt        newest COMPLETE iteration, e.g. "100"
    SAVE/iter_0000100/metadata.json               format, iteration, parallel layout, file checksums
    SAVE/iter_0000100/mp_rank_00/model_optim_rng.pt          PP == 1: mp_rank_{tp:02d}
    SAVE/iter_0000100/mp_rank_00_001/model_optim_rng.pt      PP > 1: mp_rank_{tp:02d}_{pp:03d}

Data-parallel rank 0 of each (tensor, pipeline) position writes its ``model_optim_rng.pt``: the
weights of every model chunk the rank holds (``"model"`` for one chunk, ``"model0"``, ``"model1"`` ...
for several, as Megatron's virtual pipeline; each chunk's state dict uses the full model's parameter
names), the optimizer (with its loss scaler), the LR schedule, iteration and consumed samples (our
datasets are index-based, so the consumed-sample count IS the data iterator position), the config
(``dataclasses.asdict``, as Megatron stores ``args``), the format version, and the RNG states of all
the data-parallel ranks of that position (gathered to the writer; ``rng_state[dp_rank]``). There is no
tensor-parallel RNG tracker state: dropout masks are a pure function of the seed and global sample ids.

Atomicity: every rank writes into ``SAVE/iter_0000100.tmp/``; the ranks then agree (one collective)
that all writes succeeded; only then does rank 0 add ``metadata.json`` (with each file's size and
CRC-32), rename the staging directory to ``iter_0000100`` and atomically replace the tracker. A save
that fails on any rank raises on every rank and leaves older checkpoints and the tracker untouched.
Collectives use the process group's timeout (``--distributed-timeout-minutes``), so a dead rank raises
instead of hanging. Files are read with ``torch.load(weights_only=True)`` (no code execution).

Loading restores everything, or honours ``--no-load-optim``, ``--no-load-rng`` and ``--finetune``.
A checkpoint of a different parallel layout (TP, PP, schedule, chunks per rank) is rejected with a
message naming both layouts: convert it first with ``tools/convert_checkpoint.py``
(:mod:`megatron.training.checkpoint_conversion`), which writes a weights-only checkpoint
(``"weights_only": True``) that loads with ``--finetune`` or ``--no-load-optim``. The
data-parallel size may change (weights and optimizer state are replicated over data-parallel ranks); RNG states are then not
restored, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import time
import zlib
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.distributed import a2sgd
from megatron.core.parallel_state import RankCoords

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "megatron-chimera"
CHECKPOINT_FORMAT_VERSION = 1
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
METADATA_FILENAME = "metadata.json"
STAGING_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"
NO_CHECKPOINT_MESSAGE = "no checkpoint found, starting from scratch"
_CRC_BLOCK = 1 << 22


# ----------------------------------------------------------------------------------------------
# Names and paths
# ----------------------------------------------------------------------------------------------

def iteration_dir_name(iteration: int) -> str:
    """Megatron's directory name of an iteration: ``iter_0000100``."""
    return f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """``mp_rank_{tp:02d}`` when there is no pipeline, else ``mp_rank_{tp:02d}_{pp:03d}``."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_file(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Path of the ``model_optim_rng.pt`` of one (tensor, pipeline) position."""
    return os.path.join(root, iteration_dir_name(iteration),
                        rank_dir_name(tp_rank, pp_rank, pp_size), CHECKPOINT_FILENAME)


def model_keys(num_chunks: int) -> list[str]:
    """State-dict keys of the model chunks: ``model``, or ``model0``, ``model1``, ..."""
    return ["model"] if num_chunks == 1 else [f"model{index}" for index in range(num_chunks)]


# ----------------------------------------------------------------------------------------------
# Tracker file
# ----------------------------------------------------------------------------------------------

def read_tracker(root: str) -> Optional[int]:
    """The iteration named by ``root/latest_checkpointed_iteration.txt``; None when the directory
    or the tracker does not exist. Raises ValueError for a tracker that is not an iteration."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    if text == "release":
        raise ValueError(f"{path} names a Megatron 'release' checkpoint, which this project does "
                         f"not read; convert it or point --load at a training checkpoint")
    try:
        iteration = int(text)
    except ValueError:
        raise ValueError(f"tracker file {path} contains {text!r}, expected an iteration number; "
                         f"fix or delete the file") from None
    if iteration < 0:
        raise ValueError(f"tracker file {path} names iteration {iteration} < 0; fix the file")
    return iteration


def write_tracker(root: str, iteration: int) -> None:
    """Atomically replace the tracker with ``iteration`` (temporary file, fsync, rename)."""
    path = os.path.join(root, TRACKER_FILENAME)
    temporary = path + STAGING_SUFFIX
    with open(temporary, "w") as handle:
        handle.write(f"{iteration}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(root)


def _fsync_directory(path: str) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(descriptor)


def file_crc32(path: str) -> int:
    """CRC-32 of a file, read in blocks (torch's zip reader does not verify its own CRCs)."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


# ----------------------------------------------------------------------------------------------
# Parallel layout
# ----------------------------------------------------------------------------------------------

def parallel_layout(config, num_chunks: int) -> dict:
    """What a checkpoint's files depend on: TP and PP sizes, schedule and chunks per rank.

    The data-parallel size is not part of it (weights and optimizer state are replicated over
    data-parallel ranks, so a checkpoint loads with any DP size).
    """
    parallel = config.parallel
    pipeline = parallel.pipeline_model_parallel_size
    schedule = parallel.pipeline_schedule if pipeline > 1 else "none"
    layout = {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
              "pipeline_model_parallel_size": pipeline,
              "pipeline_schedule": schedule or "1f1b",
              "model_chunks_per_rank": num_chunks}
    if schedule == "chimera":
        layout["chimera_pipelines"] = parallel.chimera_pipelines
    return layout


def describe_layout(layout: dict) -> str:
    """``TP=2, PP=4, schedule=chimera (2 pipelines), 2 model chunks per rank``."""
    schedule = layout["pipeline_schedule"]
    if "chimera_pipelines" in layout:
        schedule += f" ({layout['chimera_pipelines']} pipelines)"
    chunks = layout["model_chunks_per_rank"]
    return (f"TP={layout['tensor_model_parallel_size']}, "
            f"PP={layout['pipeline_model_parallel_size']}, schedule={schedule}, "
            f"{chunks} model chunk{'s' if chunks != 1 else ''} per rank")


# ----------------------------------------------------------------------------------------------
# RNG states (plain tensors and tuples, so weights_only loading accepts them)
# ----------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """This process's python, numpy, torch CPU and (if available) CUDA generator states."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"random": random.getstate(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "position": int(position), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached_gaussian)},
             "torch": torch.get_rng_state(),
             "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state` (the CUDA state goes to the current device)."""
    random.setstate(_as_tuple(state["random"]))
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32),
                         saved["position"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        else:
            logger.warning("the checkpoint holds a CUDA RNG state but CUDA is not available; "
                           "it is not restored")


def _as_tuple(value):
    """``random.setstate`` needs tuples; a round trip may have turned them into lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(item) for item in value)
    return value


# ----------------------------------------------------------------------------------------------
# Collectives: every rank learns every rank's error, so a failure raises everywhere (no hang)
# ----------------------------------------------------------------------------------------------

def _distributed(parallel_state) -> bool:
    return parallel_state.world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_gather(parallel_state, value) -> list:
    """``value`` of every rank, in rank order (``[value]`` in one process)."""
    if not _distributed(parallel_state):
        return [value]
    gathered = [None] * parallel_state.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _raise_for_failures(errors: list, what: str) -> None:
    """Raise naming every rank whose entry of ``errors`` (rank order) is a message."""
    failures = [(rank, message) for rank, message in enumerate(errors) if message]
    if failures:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
        raise RuntimeError(f"{what} failed on {len(failures)} rank(s): {details}")


def _raise_if_any_failed(parallel_state, error: Optional[str], what: str) -> None:
    """Share ``error`` (None = success) with every rank; raise on all ranks if any failed."""
    _raise_for_failures(_all_gather(parallel_state, error), what)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _gather_rng_states_over_data_parallel(parallel_state, state: Optional[dict]
                                          ) -> Optional[list]:
    """Every data-parallel rank's ``state`` (its RNG state), on data-parallel rank 0 (None
    elsewhere). Collective over the data-parallel group."""
    if parallel_state.dp_size == 1 or not _distributed(parallel_state):
        return [state]
    coords = parallel_state.coords
    writer = parallel_state.layout.rank(RankCoords(tp=coords.tp, dp=0, pp=coords.pp))
    gathered = [None] * parallel_state.dp_size if parallel_state.rank == writer else None
    dist.gather_object(state, gathered, dst=writer, group=parallel_state.data_group)
    return gathered


# ----------------------------------------------------------------------------------------------
# Optimizer: state from the checkpoint, hyper-parameters from the current flags
# ----------------------------------------------------------------------------------------------

def _load_optimizer_state(optimizer, state: dict) -> None:
    """Load ``optimizer`` (a MegatronOptimizer) but keep the current param-group settings.

    torch's ``load_state_dict`` would also restore the saved groups' settings (betas, eps, weight
    decay, fused/foreach); the current flags win instead, as they do for the LR schedule's shape.
    """
    current = [{key: value for key, value in group.items() if key != "params"}
               for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, current):
        group.update(settings)


# Sharded optimizer state (--use-distributed-optimizer): the rank file records only this marker;
# every rank's shard of the optimizer state is in its own file next to it.
_SHARDED_MARKER = {"sharded": True}


def _is_sharded(optimizer) -> bool:
    return hasattr(optimizer, "shards")


def optimizer_shard_name(dp_rank: int) -> str:
    """``distrib_optim_dp000.pt``: one data-parallel rank's optimizer shard of a (tp, pp) position."""
    return f"distrib_optim_dp{dp_rank:03d}.pt"


def _write_optimizer_shard(components, state, staging_dir: str) -> tuple[str, dict]:
    parallel_state = components.parallel_state
    relative = os.path.join(rank_dir_name(parallel_state.tp_rank, parallel_state.pp_rank,
                                          parallel_state.pp_size),
                            optimizer_shard_name(parallel_state.dp_rank))
    path = os.path.join(staging_dir, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({**_checkpoint_header(components, state),
               "optimizer": components.optimizer.state_dict()}, path)
    return relative, {"size": os.path.getsize(path), "crc32": file_crc32(path)}


def _optimizer_state_for_this_rank(path: str, saved: dict, components, iteration_dir: str,
                                   metadata: dict) -> dict:
    """The optimizer state this rank loads: the rank file's, or its shard file's (checked)."""
    parallel_state = components.parallel_state
    saved_sharded = bool(saved.get("sharded"))
    if saved_sharded != _is_sharded(components.optimizer):
        was, now = (("with", "without") if saved_sharded else ("without", "with"))
        raise CheckpointError(
            f"checkpoint file {path} was saved {was} --use-distributed-optimizer and this run is "
            f"{now} it; resume with the same setting, or load the weights only with "
            f"--no-load-optim (the optimizer state starts afresh)")
    if not saved_sharded:
        return saved
    if saved["data_parallel_size"] != parallel_state.dp_size:
        raise CheckpointError(
            f"checkpoint file {path} holds optimizer shards of {saved['data_parallel_size']} "
            f"data-parallel ranks and this run has {parallel_state.dp_size}; resume with the same "
            f"data-parallel size or pass --no-load-optim")
    relative = os.path.join(os.path.relpath(os.path.dirname(path), iteration_dir),
                            optimizer_shard_name(parallel_state.dp_rank))
    recorded = metadata["files"].get(relative)
    if recorded is None:
        raise CheckpointError(f"{os.path.join(iteration_dir, METADATA_FILENAME)} lists no "
                              f"{relative}; the checkpoint is incomplete")
    shard_path = os.path.join(iteration_dir, relative)
    _verify_file(shard_path, recorded)
    return load_file(shard_path)["optimizer"]


# ----------------------------------------------------------------------------------------------
# The hook
# ----------------------------------------------------------------------------------------------

def _checkpoint_header(components, state) -> dict:
    """What both a rank's file and the iteration's metadata record: format, progress, layout."""
    return {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "layout": parallel_layout(components.config, len(components.model_chunks)),
        "data_parallel_size": components.parallel_state.dp_size,
    }


class Checkpointer:
    """The training loop's checkpointing hook (``pretrain(..., checkpointing=Checkpointer(config))``).

    Args:
        config: the validated MegatronConfig; ``config.checkpoint`` holds ``--save``, ``--load``,
            ``--no-load-optim``, ``--no-load-rng`` and ``--finetune``.
        log: where global rank 0's progress lines go (Megatron prints them on rank 0).
    """

    def __init__(self, config, *, log: Callable[[str], None] = print):
        self.config = config
        self.log = log

    # ---- save ------------------------------------------------------------------------------

    def save(self, components, state) -> str:
        """Write the checkpoint of ``state.iteration`` to ``--save``; returns its directory.

        Collective: every rank must call it. Raises RuntimeError on every rank if any rank failed;
        the previous checkpoint and the tracker are then unchanged.
        """
        root = self.config.checkpoint.save
        if not root:
            raise ValueError("Checkpointer.save needs --save DIR; pass --save")
        parallel_state = components.parallel_state
        is_first = parallel_state.rank == 0
        iteration = state.iteration
        final_dir = os.path.join(root, iteration_dir_name(iteration))
        staging_dir = final_dir + STAGING_SUFFIX
        if is_first:
            self.log(f"saving checkpoint at iteration {iteration:7d} to {root}")
        started = time.perf_counter()

        error = None
        if is_first:
            try:  # a stale staging directory is what a crashed save leaves behind
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(staging_dir, ignore_errors=True)
                os.makedirs(staging_dir)
            except OSError as caught:
                error = _describe(caught)
        _raise_if_any_failed(parallel_state, error, f"preparing checkpoint directory {staging_dir}")

        # Every rank takes part in the gather even if capturing failed (no rank left waiting);
        # errors are reported to every rank by the all-gather below.
        written, error, rng_state = [], None, None
        try:
            rng_state = capture_rng_state()
        except Exception as caught:
            error = _describe(caught)
        rng_states = _gather_rng_states_over_data_parallel(parallel_state, rng_state)
        reducer_states = _gather_rng_states_over_data_parallel(  # A2SGD error buffers, if any
            parallel_state, a2sgd.reducer_state(components.gradient_reducers))
        if error is None and parallel_state.dp_rank == 0:
            try:
                if any(entry is None for entry in rng_states):
                    raise RuntimeError("a data-parallel rank could not capture its RNG state")
                written.append(self._write_rank_file(components, state, staging_dir,
                                                     rng_states, reducer_states))
            except Exception as caught:
                error = _describe(caught)
        if error is None and _is_sharded(components.optimizer):
            try:  # --use-distributed-optimizer: every rank writes its own optimizer shard
                written.append(_write_optimizer_shard(components, state, staging_dir))
            except Exception as caught:
                error = _describe(caught)
        try:
            gathered = _all_gather(parallel_state, (error, written))
            _raise_for_failures([message for message, _ in gathered],
                                f"saving checkpoint at iteration {iteration} to {root} (the "
                                f"previous checkpoint and {TRACKER_FILENAME} are unchanged)")
        except BaseException:
            if is_first:
                shutil.rmtree(staging_dir, ignore_errors=True)
            raise

        error = None
        if is_first:
            try:
                files = dict(entry for _, entries in gathered for entry in entries or ())
                self._publish(components, state, root, staging_dir, final_dir, files)
            except Exception as caught:
                error = _describe(caught)
                shutil.rmtree(staging_dir, ignore_errors=True)
        _raise_if_any_failed(parallel_state, error,
                             f"publishing checkpoint at iteration {iteration} to {root}")
        if is_first:
            self.log(f"  successfully saved checkpoint at iteration {iteration:7d} to {root} "
                     f"({time.perf_counter() - started:.2f} s)")
        return final_dir

    def _write_rank_file(self, components, state, staging_dir: str, rng_states: list,
                         reducer_states: Optional[list] = None) -> tuple[str, dict]:
        """Write this (tp, pp) position's file; return (relative path, {size, crc32})."""
        parallel_state = components.parallel_state
        relative = os.path.join(rank_dir_name(parallel_state.tp_rank, parallel_state.pp_rank,
                                              parallel_state.pp_size), CHECKPOINT_FILENAME)
        payload = {
            **_checkpoint_header(components, state),
            "config": dataclasses.asdict(components.config),
            "optimizer": (_SHARDED_MARKER | {"data_parallel_size": parallel_state.dp_size}
                          if _is_sharded(components.optimizer)
                          else components.optimizer.state_dict()),
            "opt_param_scheduler": components.lr_scheduler.state_dict(),
            "rng_state": rng_states,
        }
        if reducer_states and reducer_states[0] is not None:
            payload["gradient_reducer_state"] = reducer_states
        for key, chunk in zip(model_keys(len(components.model_chunks)), components.model_chunks):
            payload[key] = chunk.state_dict()
        path = os.path.join(staging_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(payload, path)
        return relative, {"size": os.path.getsize(path), "crc32": file_crc32(path)}

    def _publish(self, components, state, root: str, staging_dir: str, final_dir: str,
                 files: dict) -> None:
        """Rank 0, after every rank wrote: metadata, rename into place, then the tracker."""
        metadata = {
            **_checkpoint_header(components, state),
            "files": dict(sorted(files.items())),
        }
        metadata_path = os.path.join(staging_dir, METADATA_FILENAME)
        with open(metadata_path, "w") as handle:
            json.dump(metadata, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        for directory in {os.path.dirname(os.path.join(staging_dir, name)) for name in files}:
            _fsync_directory(directory)
        _fsync_directory(staging_dir)
        # Re-saving an existing iteration: move the old copy aside, put the new one in place,
        # and only then delete the old one (an interruption leaves it as iter_X.replaced).
        replaced = final_dir + REPLACED_SUFFIX
        if os.path.exists(final_dir):
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final_dir, replaced)
        try:
            os.replace(staging_dir, final_dir)
        except OSError:
            if os.path.exists(replaced):  # put the old copy back where the tracker expects it
                os.replace(replaced, final_dir)
            raise
        _fsync_directory(root)
        write_tracker(root, state.iteration)
        shutil.rmtree(replaced, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------

    def load(self, components):
        """Restore the checkpoint named by ``--load``'s tracker; return its TrainingState.

        Returns None (and logs that training starts from scratch) when the directory or the
        tracker does not exist. Collective: every rank must call it; an error on any rank raises
        on every rank.
        """
        # imported here, not at the top, so that training.py may import this module
        from megatron.training.training import TrainingState

        checkpoint_config = self.config.checkpoint
        root = checkpoint_config.load
        parallel_state = components.parallel_state
        is_first = parallel_state.rank == 0

        iteration, error = None, None
        try:
            iteration = read_tracker(root) if root else None
        except (OSError, ValueError) as caught:
            error = _describe(caught)
        gathered = _all_gather(parallel_state, (error, iteration))
        _raise_for_failures([message for message, _ in gathered],
                            f"reading the checkpoint tracker in {root}")
        if len({value for _, value in gathered}) != 1:
            raise RuntimeError(f"ranks read different iterations from {root}/{TRACKER_FILENAME} "
                               f"({sorted({value for _, value in gathered}, key=str)}); every "
                               f"rank must see the same (shared) checkpoint directory")
        if iteration is None:
            if is_first:
                self.log(f"{NO_CHECKPOINT_MESSAGE} (no {TRACKER_FILENAME} in {root})")
            return None
        if is_first:
            self.log(f"loading checkpoint from {root} at iteration {iteration}")

        payload, error = None, None
        try:
            payload = self._read_and_check(components, root, iteration)
        except Exception as caught:
            error = _describe(caught) if not isinstance(caught, CheckpointError) else str(caught)
        _raise_if_any_failed(parallel_state, error, f"loading checkpoint {root} "
                                                    f"(iteration {iteration})")

        result, error = None, None
        try:
            result = self._apply(components, payload, TrainingState)
        except Exception as caught:
            error = _describe(caught)
        _raise_if_any_failed(parallel_state, error, f"restoring checkpoint {root} "
                                                    f"(iteration {iteration})")
        if is_first:
            loaded = "weights only (--finetune), starting at iteration 0" \
                if checkpoint_config.finetune else f"at iteration {iteration}"
            self.log(f"  successfully loaded checkpoint from {root} {loaded}")
        return result

    def _read_and_check(self, components, root: str, iteration: int) -> dict:
        """Read this rank's file and check it against the metadata and the current run."""
        parallel_state = components.parallel_state
        iteration_dir = os.path.join(root, iteration_dir_name(iteration))
        if not os.path.isdir(iteration_dir):
            hint = ""
            if os.path.isdir(iteration_dir + REPLACED_SUFFIX):
                hint = (f"; a save replacing it was interrupted: rename "
                        f"{iteration_dir + REPLACED_SUFFIX} to {iteration_dir}")
            raise CheckpointError(f"{os.path.join(root, TRACKER_FILENAME)} names iteration "
                                  f"{iteration}, but {iteration_dir} does not exist{hint}")
        metadata = _read_metadata(os.path.join(iteration_dir, METADATA_FILENAME))
        expected = parallel_layout(components.config, len(components.model_chunks))
        if metadata["layout"] != expected:
            raise CheckpointError(
                f"checkpoint {iteration_dir} was saved with parallel layout "
                f"[{describe_layout(metadata['layout'])}] but this run uses "
                f"[{describe_layout(expected)}]; loading another layout is not supported: resume "
                f"with the saved layout's flags, or convert "
                f"the weights with tools/convert_checkpoint.py and load them with --finetune or "
                f"--no-load-optim")
        path = checkpoint_file(root, iteration, parallel_state.tp_rank, parallel_state.pp_rank,
                               parallel_state.pp_size)
        relative = os.path.relpath(path, iteration_dir)
        recorded = metadata["files"].get(relative)
        if recorded is None:
            raise CheckpointError(f"{os.path.join(iteration_dir, METADATA_FILENAME)} lists no "
                                  f"{relative}; the checkpoint is incomplete")
        _verify_file(path, recorded)
        payload = load_file(path)
        for key in ("format", "iteration", "layout", "optimizer", "opt_param_scheduler",
                    "rng_state", *model_keys(len(components.model_chunks))):
            if key not in payload:
                raise CheckpointError(f"checkpoint file {path} has no {key!r} entry; it was not "
                                      f"written by this project's checkpointing")
        if payload["format"] != CHECKPOINT_FORMAT or \
                payload.get("format_version") != CHECKPOINT_FORMAT_VERSION:
            raise CheckpointError(f"checkpoint file {path} has format {payload['format']!r} "
                                  f"version {payload.get('format_version')}; this build reads "
                                  f"{CHECKPOINT_FORMAT!r} version {CHECKPOINT_FORMAT_VERSION}")
        if payload["iteration"] != iteration or payload["layout"] != metadata["layout"]:
            raise CheckpointError(f"checkpoint file {path} holds iteration "
                                  f"{payload['iteration']}, but its directory is iteration "
                                  f"{iteration}; the checkpoint directory was mixed up")
        _check_model_flags(path, payload.get("config", {}).get("model", {}),
                           dataclasses.asdict(components.config.model))
        if payload.get("weights_only") and not (self.config.checkpoint.finetune
                                                or self.config.checkpoint.no_load_optim):
            raise CheckpointError(f"checkpoint file {path} holds weights only (converted from "
                                  f"another parallel layout by tools/convert_checkpoint.py): it "
                                  f"has no optimizer state; pass --finetune or --no-load-optim")
        for key, chunk in zip(model_keys(len(components.model_chunks)), components.model_chunks):
            _check_model_state(path, key, payload[key], chunk)
        if not (self.config.checkpoint.finetune or self.config.checkpoint.no_load_optim):
            payload["optimizer"] = _optimizer_state_for_this_rank(
                path, payload["optimizer"], components, iteration_dir, metadata)
            _check_optimizer_groups(path, payload["optimizer"], components.optimizer)
        return payload

    def _apply(self, components, payload: dict, training_state_class):
        """Copy the checked payload into the model, optimizer, schedule and RNGs."""
        checkpoint_config = self.config.checkpoint
        parallel_state = components.parallel_state
        for key, chunk in zip(model_keys(len(components.model_chunks)), components.model_chunks):
            chunk.load_state_dict(payload[key], strict=True)
        if checkpoint_config.finetune:
            return training_state_class()
        if not checkpoint_config.no_load_optim:
            _load_optimizer_state(components.optimizer, payload["optimizer"])
            components.lr_scheduler.load_state_dict(payload["opt_param_scheduler"])
            a2sgd.load_reducer_state(components.gradient_reducers,
                                     payload.get("gradient_reducer_state"), parallel_state.dp_rank)
        if payload.get("weights_only"):
            if parallel_state.rank == 0:
                self.log("  the checkpoint holds weights only (converted from "
                         f"[{payload.get('converted_from', 'another layout')}]): the optimizer, "
                         "LR schedule and RNG states start afresh")
        elif not checkpoint_config.no_load_rng:
            rng_states = payload["rng_state"]
            if len(rng_states) == parallel_state.dp_size:
                restore_rng_state(rng_states[parallel_state.dp_rank])
            elif parallel_state.rank == 0:
                logger.warning("the checkpoint was saved with data-parallel size %d and this run "
                               "uses %d: RNG states are not restored", len(rng_states),
                               parallel_state.dp_size)
        return training_state_class(
            iteration=int(payload["iteration"]),
            consumed_train_samples=int(payload["consumed_train_samples"]),
            consumed_valid_samples=int(payload["consumed_valid_samples"]))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file and the fix."""


def save_file(payload: dict, path: str) -> None:
    """``torch.save`` to ``path`` and fsync it (the staging directory makes it atomic)."""
    with open(path, "wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())


def load_file(path: str) -> dict:
    """``torch.load`` of a checkpoint file on the CPU, without executing code from it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({_describe(error)}); it "
                              f"is corrupt or truncated: load an older iteration (edit "
                              f"{TRACKER_FILENAME}) or save again") from error


def _read_metadata(path: str) -> dict:
    try:
        with open(path) as handle:
            metadata = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete or not written "
                              f"by this project") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} cannot be read ({_describe(error)}); the checkpoint is "
                              f"corrupt") from None
    if metadata.get("format") != CHECKPOINT_FORMAT or \
            metadata.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(f"{path} describes format {metadata.get('format')!r} version "
                              f"{metadata.get('format_version')}; this build reads "
                              f"{CHECKPOINT_FORMAT!r} version {CHECKPOINT_FORMAT_VERSION}")
    for key in ("layout", "files"):
        if key not in metadata:
            raise CheckpointError(f"{path} has no {key!r} entry; the checkpoint is corrupt")
    return metadata


def _verify_file(path: str, recorded: dict) -> None:
    """Size and CRC-32 against the metadata: catches truncation and flipped bytes."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != recorded["size"]:
        raise CheckpointError(f"checkpoint file {path} has {size} bytes, but {recorded['size']} "
                              f"were written; it is truncated or corrupt")
    if file_crc32(path) != recorded["crc32"]:
        raise CheckpointError(f"checkpoint file {path} does not match its CRC-32 in "
                              f"{METADATA_FILENAME}; it is corrupt")


# Architecture flags a checkpoint's weights depend on (Megatron's check_checkpoint_args checks
# the same kind of list); the other flags may change on resume.
ARCHITECTURE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "max_position_embeddings", "padded_vocab_size",
                      "untie_embeddings_and_output_weights", "normalization",
                      "position_embedding_type", "swiglu", "disable_bias_linear")


def _check_model_flags(path: str, saved: dict, current: dict) -> None:
    """Name the architecture flags that differ from the saved run's, before any shape check."""
    differences = [f"--{name.replace('_', '-')} {saved[name]} (this run: {current[name]})"
                   for name in ARCHITECTURE_FLAGS
                   if name in saved and name in current and saved[name] != current[name]]
    if differences:
        raise CheckpointError(f"checkpoint file {path} was saved with a different model: "
                              f"{'; '.join(differences)}; use the saved run's model flags")


def _check_optimizer_groups(path: str, saved: dict, optimizer) -> None:
    """Same parameter groups (count and sizes) as this run's optimizer."""
    saved_sizes = [len(group["params"]) for group in saved["optimizer"]["param_groups"]]
    current_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != current_sizes:
        raise CheckpointError(
            f"checkpoint file {path}: the optimizer has parameter groups of sizes {saved_sizes}, "
            f"this run's optimizer {current_sizes}; pass --no-load-optim to start the optimizer "
            f"afresh")


def _check_model_state(path: str, key: str, saved: dict, chunk: torch.nn.Module) -> None:
    """Same parameter names and shapes as the chunk, so loading cannot fail halfway."""
    current = chunk.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint file {path}: {key!r} does not match this run's model (missing "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}); the model flags differ "
            f"from the saved run's")
    for name, tensor in current.items():
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint file {path}: {key}.{name} has shape {tuple(saved[name].shape)}, "
                f"this run's model has {tuple(tensor.shape)}; the model flags differ from the "
                f"saved run's")
