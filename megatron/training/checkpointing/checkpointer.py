"""The training loop's checkpointing hook: :class:`Checkpointer` saves (staged, agreed on by every
rank, then published atomically by rank 0) and loads (checked completely before anything is applied).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Callable, Optional

from megatron.core.distributed.reduction import load_reducer_states, reducer_states
from megatron.training.checkpointing import torch_dist
from megatron.training.checkpointing.resharding import read_in_another_layout
from megatron.training.checkpointing.background import BackgroundSaver
from megatron.training.checkpointing.retention import prune_checkpoints
from megatron.training.checkpointing.collectives import (_all_gather,
                                                        _gather_rng_states_over_data_parallel,
                                                        _raise_for_failures, _raise_if_any_failed)
from megatron.training.checkpointing.files import (CHECKPOINT_FILENAME, CHECKPOINT_FORMAT,
                                                  CHECKPOINT_FORMAT_VERSION, METADATA_FILENAME,
                                                  NO_CHECKPOINT_MESSAGE, REPLACED_SUFFIX,
                                                  STAGING_SUFFIX, TRACKER_FILENAME,
                                                  CheckpointError, _describe, _fsync_directory,
                                                  empty_staging_dir, weights_only_note,
                                                  _read_metadata, _verify_file, checkpoint_file,
                                                  file_crc32, iteration_dir_name, load_file,
                                                  model_keys, rank_dir_name, read_tracker,
                                                  save_file, write_tracker)
from megatron.training.checkpointing.optimizer_shards import (is_sharded, optimizer_state_entry,
                                                             optimizer_state_for_this_rank,
                                                             write_optimizer_shard)
from megatron.training.training_state import TrainingState
from megatron.training.checkpointing.state import (_check_model_flags, _check_model_state,
                                                  _check_optimizer_groups, _load_optimizer_state,
                                                  capture_rng_state,
                                                  parallel_layout, restore_rng_state,
                                                  runtime_registry)

logger = logging.getLogger(__name__)

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
        "layout": parallel_layout(components.config, len(components.model_chunks),
                                  runtime_registry(components)),
        "data_parallel_size": components.parallel_state.dp_size,
    }


class Checkpointer:
    """The training loop's checkpointing hook (``pretrain(..., checkpointing=Checkpointer(config))``).

    Args:
        config: the validated MegatronConfig; ``config.checkpoint`` holds ``--save``, ``--load``,
            ``--no-save-optim``, ``--no-save-rng``, ``--no-load-optim``, ``--no-load-rng`` and
            ``--finetune``.
        log: where global rank 0's progress lines go (Megatron prints them on rank 0).
    """

    def __init__(self, config, *, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        self._background: Optional[BackgroundSaver] = None  # --async-save, at the first save
        self._run_fields: dict = {}  # torch_dist metadata fields of the run, at the first one
        self._noted_sync = False

    @property
    def pending(self):
        """The background save in flight (``--async-save``), or None."""
        return None if self._background is None else self._background.pending

    @property
    def saves_in_background(self) -> bool:
        """``--async-save`` with ``--ckpt-format torch_dist`` (the torch format saves in the
        foreground; a note says so when the checkpointer is first used)."""
        return bool(getattr(self.config.checkpoint, "async_save", False)) and \
            self.ckpt_format == torch_dist.TORCH_DIST

    @property
    def ckpt_format(self) -> str:
        """``--ckpt-format``: ``torch`` (a file per tensor/pipeline position) or ``torch_dist``
        (global tensors through torch.distributed.checkpoint). Loading detects the format."""
        return getattr(self.config.checkpoint, "ckpt_format", torch_dist.TORCH_DIST)

    # ---- save ------------------------------------------------------------------------------

    def save(self, components, state) -> str:
        """Write the checkpoint of ``state.iteration`` to ``--save``; returns its directory.

        Collective: every rank must call it. Raises RuntimeError on every rank if any rank failed;
        the previous checkpoint and the tracker are then unchanged. Three agreed steps: prepare
        the staging directory, write every (tensor, pipeline) position's file, publish. With
        ``--async-save`` (torch_dist) the writing, the agreement and the publishing happen in
        the background (:mod:`.background`); a failure raises at the next save or at
        :meth:`finish`.
        """
        components.optimizer.finish_parameter_gather()  # --overlap-param-gather: weights settled
        root = self.config.checkpoint.save
        if not root:
            raise ValueError("Checkpointer.save needs --save DIR; pass --save")
        is_first = components.parallel_state.rank == 0
        if is_first and getattr(self.config.checkpoint, "async_save", False) and \
                not self.saves_in_background and not self._noted_sync:
            self._noted_sync = True
            self.log("  note: --async-save applies to --ckpt-format torch_dist; the torch format "
                     "is saved in the foreground")
        final_dir = os.path.join(root, iteration_dir_name(state.iteration))
        staging_dir = final_dir + STAGING_SUFFIX
        if is_first:
            self.log(f"saving checkpoint at iteration {state.iteration:7d} to {root}")
            omitted = [what for what, flag in (("optimizer state and LR schedule",
                                                self.config.checkpoint.no_save_optim),
                                               ("RNG states", self.config.checkpoint.no_save_rng))
                       if flag]
            if omitted:
                self.log(f"  without {' and '.join(omitted)} (--no-save-optim / --no-save-rng)")
        started = time.perf_counter()
        if self.saves_in_background:
            self._save_in_background(components, state, root, staging_dir, final_dir)
            return final_dir
        self._prepare_staging(components, root, staging_dir)
        extra = None
        if self.ckpt_format == torch_dist.TORCH_DIST:
            try:
                files = torch_dist.save_files(components, state, self.config.checkpoint, root,
                                              staging_dir)
            except BaseException:
                if components.parallel_state.rank == 0:
                    shutil.rmtree(staging_dir, ignore_errors=True)
                raise
            extra = torch_dist.metadata_fields(components, self.config.checkpoint)
        else:
            files = self._write_all_rank_files(components, state, root, staging_dir)
        self._publish_agreed(components, state, root, staging_dir, final_dir, files, extra)
        if is_first:
            self.log(f"  successfully saved checkpoint at iteration {state.iteration:7d} to "
                     f"{root} ({time.perf_counter() - started:.2f} s)")
            if self.config.checkpoint.save_retain_interval is not None:
                prune_checkpoints(root, state.iteration,
                                  self.config.checkpoint.save_retain_interval, self.log)
        return final_dir

    def _save_in_background(self, components, state, root: str, staging_dir: str,
                            final_dir: str) -> None:
        """--async-save: wait for and agree on the previous background save, copy the state and
        start writing it; rank 0 publishes it in the background once every rank's write finished
        (:mod:`.background`)."""
        if self._background is None:
            self._background = BackgroundSaver(
                self.log, bool(getattr(self.config.checkpoint, "use_persistent_ckpt_worker",
                                       False)))
            # the run's layout and model flags: the same at every save of the run
            self._run_fields = torch_dist.metadata_fields(components, self.config.checkpoint)
        header = {**_checkpoint_header(components, state), **self._run_fields} \
            if components.parallel_state.rank == 0 else {}  # only rank 0 publishes
        retain = self.config.checkpoint.save_retain_interval
        started = time.perf_counter()
        iteration = state.iteration  # training advances ``state`` while this is written

        def publish(files: dict) -> list:  # rank 0, in the background
            publish_checkpoint(root, staging_dir, final_dir, header, files, iteration)
            lines = [f"  successfully saved checkpoint at iteration {iteration:7d} to "
                     f"{root} ({time.perf_counter() - started:.2f} s, in the background)"]
            if retain is not None:
                prune_checkpoints(root, iteration, retain, lines.append)
            return lines

        self._background.start(components, state, self.config.checkpoint, root, staging_dir,
                               publish)

    def finish(self, components, last: bool = False) -> None:
        """Wait for the background save in flight (if any), published by then on success, and
        agree on its outcome (collective): raises on every rank if any rank's part failed. The
        training loop calls it at the end of training (``last``: the persistent writer process,
        if any, is stopped too)."""
        if self._background is not None:
            self._background.finish(components.parallel_state, stop_writer=last)

    def _prepare_staging(self, components, root: str, staging_dir: str) -> None:
        """Rank 0 creates an empty staging directory (removing what a crashed save left)."""
        error = None
        if components.parallel_state.rank == 0:
            try:
                empty_staging_dir(root, staging_dir)
            except OSError as caught:
                error = _describe(caught)
        _raise_if_any_failed(components.parallel_state, error,
                             f"preparing checkpoint directory {staging_dir}")

    def _write_all_rank_files(self, components, state, root: str, staging_dir: str) -> dict:
        """Each data-parallel rank 0 writes its position's file; returns {relative path: record}.

        Every rank takes part in the RNG gather even if capturing failed (no rank left waiting);
        errors reach every rank through the all-gather, and a failure removes the staging directory.
        With ``--no-save-rng`` / ``--no-save-optim`` (the same on every rank) the RNG states /
        the optimizer state, LR schedule and gradient-reducer state are neither gathered nor saved.
        """
        parallel_state = components.parallel_state
        save_optimizer = not self.config.checkpoint.no_save_optim
        written, error, rng_state, rng_states = [], None, None, None
        gathered_reducer_states = None
        if not self.config.checkpoint.no_save_rng:
            try:
                rng_state = capture_rng_state()
            except Exception as caught:
                error = _describe(caught)
            rng_states = _gather_rng_states_over_data_parallel(parallel_state, rng_state)
        if save_optimizer:
            gathered_reducer_states = _gather_rng_states_over_data_parallel(  # e.g. error buffers
                parallel_state, reducer_states(components.gradient_reducers))
        rerun_states = None
        if state.rerun_state is not None:  # set on every rank alike (the engine's exit 16)
            rerun_states = _gather_rng_states_over_data_parallel(parallel_state,
                                                                 state.rerun_state)
        if error is None and parallel_state.dp_rank == 0:
            try:
                if rng_states is not None and any(entry is None for entry in rng_states):
                    raise RuntimeError("a data-parallel rank could not capture its RNG state")
                written.append(self._write_rank_file(components, state, staging_dir, rng_states,
                                                     gathered_reducer_states, rerun_states))
            except Exception as caught:
                error = _describe(caught)
        if error is None and save_optimizer and is_sharded(components.optimizer):
            try:  # --use-distributed-optimizer: every rank writes its own optimizer shard
                written.append(write_optimizer_shard(
                    components, _checkpoint_header(components, state), staging_dir))
            except Exception as caught:
                error = _describe(caught)
        try:
            gathered = _all_gather(parallel_state, (error, written))
            _raise_for_failures([message for message, _ in gathered],
                                f"saving checkpoint at iteration {state.iteration} to {root} (the "
                                f"previous checkpoint and {TRACKER_FILENAME} are unchanged)")
        except BaseException:
            if parallel_state.rank == 0:
                shutil.rmtree(staging_dir, ignore_errors=True)
            raise
        return dict(entry for _, entries in gathered for entry in entries or ())

    def _publish_agreed(self, components, state, root: str, staging_dir: str, final_dir: str,
                        files: dict, extra: Optional[dict] = None) -> None:
        """Rank 0 publishes; every rank learns whether it succeeded."""
        error = None
        if components.parallel_state.rank == 0:
            try:
                self._publish(components, state, root, staging_dir, final_dir, files, extra)
            except Exception as caught:
                error = _describe(caught)
                shutil.rmtree(staging_dir, ignore_errors=True)
        _raise_if_any_failed(components.parallel_state, error,
                             f"publishing checkpoint at iteration {state.iteration} to {root}")

    def _write_rank_file(self, components, state, staging_dir: str, rng_states: Optional[list],
                         gathered_reducer_states: Optional[list] = None,
                         rerun_states: Optional[list] = None) -> tuple[str, dict]:
        """Write this (tp, pp) position's file; return (relative path, {size, crc32}).

        What ``--no-save-optim`` / ``--no-save-rng`` leave out is stored as None (the key stays,
        so the loader can tell a deliberate omission from a file that is not ours)."""
        parallel_state = components.parallel_state
        relative = os.path.join(rank_dir_name(parallel_state.tp_rank, parallel_state.pp_rank,
                                              parallel_state.pp_size), CHECKPOINT_FILENAME)
        save_optimizer = not self.config.checkpoint.no_save_optim
        payload = {
            **_checkpoint_header(components, state),
            "config": dataclasses.asdict(components.config),
            "optimizer": optimizer_state_entry(components) if save_optimizer else None,
            "opt_param_scheduler": components.lr_scheduler.state_dict() if save_optimizer else None,
            "rng_state": rng_states,
        }
        if gathered_reducer_states and gathered_reducer_states[0] is not None:
            payload["gradient_reducer_state"] = gathered_reducer_states  # per data-parallel rank
        if rerun_states is not None:
            payload["rerun_state"] = rerun_states  # per data-parallel rank
        for key, chunk in zip(model_keys(len(components.model_chunks)), components.model_chunks):
            payload[key] = chunk.state_dict()
        path = os.path.join(staging_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(payload, path)
        return relative, {"size": os.path.getsize(path), "crc32": file_crc32(path)}

    def _publish(self, components, state, root: str, staging_dir: str, final_dir: str,
                 files: dict, extra: Optional[dict] = None) -> None:
        """Rank 0, after every rank wrote: metadata, rename into place, then the tracker."""
        publish_checkpoint(root, staging_dir, final_dir,
                           {**_checkpoint_header(components, state), **(extra or {})}, files,
                           state.iteration)

    # ---- load ------------------------------------------------------------------------------

    def load(self, components):
        """Restore the checkpoint named by ``--load``'s tracker; return its TrainingState.

        Returns None (and logs that training starts from scratch) when the directory or the
        tracker does not exist. Collective: every rank must call it; an error on any rank raises
        on every rank.
        """
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
            if self.config.checkpoint.exit_on_missing_checkpoint:
                raise CheckpointError(f"--exit-on-missing-checkpoint: --load {root} holds no "
                                      f"checkpoint (no {TRACKER_FILENAME}); fix the path, or drop "
                                      f"the flag to start from scratch")
            if is_first:
                self.log(f"{NO_CHECKPOINT_MESSAGE} (no {TRACKER_FILENAME} in {root})")
            return None
        if is_first:
            self.log(f"loading checkpoint from {root} at iteration {iteration}")

        iteration_dir = os.path.join(root, iteration_dir_name(iteration))
        metadata_path = os.path.join(iteration_dir, METADATA_FILENAME)
        metadata, error = None, None
        try:
            if os.path.isfile(metadata_path):
                metadata = _read_metadata(metadata_path)
        except Exception as caught:
            error = str(caught)
        _raise_if_any_failed(parallel_state, error, f"loading checkpoint {root} "
                                                    f"(iteration {iteration})")
        if metadata is not None and torch_dist.is_torch_dist(metadata):
            result = torch_dist.load(components, checkpoint_config, iteration_dir, metadata,
                                     self.log, TrainingState)
            if is_first:
                loaded = "weights only (--finetune), starting at iteration 0" \
                    if checkpoint_config.finetune else f"at iteration {iteration}"
                self.log(f"  successfully loaded checkpoint from {root} {loaded}")
            return result

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
        expected = parallel_layout(components.config, len(components.model_chunks),
                                   runtime_registry(components))
        if metadata["layout"] != expected:  # another layout: through the global keys
            return read_in_another_layout(components, self.config.checkpoint, iteration_dir,
                                          metadata, expected)
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
        _check_saved_states_are_present(path, payload, self.config.checkpoint)
        for key, chunk in zip(model_keys(len(components.model_chunks)), components.model_chunks):
            _check_model_state(path, key, payload[key], chunk)
        if not (self.config.checkpoint.finetune or self.config.checkpoint.no_load_optim):
            payload["optimizer"] = optimizer_state_for_this_rank(
                path, payload["optimizer"], components, iteration_dir, metadata)
            _check_optimizer_groups(path, payload["optimizer"], components.optimizer)
        return payload

    def _apply(self, components, payload: dict, training_state_class):
        """Copy the checked payload into the model, optimizer, schedule and RNGs."""
        checkpoint_config = self.config.checkpoint
        parallel_state = components.parallel_state
        for key, chunk in zip(model_keys(len(components.model_chunks)), components.model_chunks):
            chunk.load_state_dict(payload[key], strict=True)
        if payload.get("resharded") and parallel_state.rank == 0:  # from another layout
            self.log(payload["resharded"])
        if checkpoint_config.finetune:
            return training_state_class()
        if not checkpoint_config.no_load_optim:
            _load_optimizer_state(components.optimizer, payload["optimizer"])
            differences = components.lr_scheduler.load_state_dict(
                payload["opt_param_scheduler"],
                use_checkpoint_values=checkpoint_config.use_checkpoint_opt_param_scheduler)
            if differences and parallel_state.rank == 0 and \
                    not checkpoint_config.override_opt_param_scheduler:
                self.log("  learning-rate schedule of the checkpoint differs from the flags: "
                         + "; ".join(differences))
            load_reducer_states(components.gradient_reducers,
                                payload.get("gradient_reducer_state"), parallel_state.dp_rank)
        if payload.get("weights_only"):
            if parallel_state.rank == 0:
                self.log(weights_only_note(payload.get("converted_from")))
        elif not checkpoint_config.no_load_rng and not payload.get("resharded"):
            rng_states = payload["rng_state"]
            if len(rng_states) == parallel_state.dp_size:
                restore_rng_state(rng_states[parallel_state.dp_rank])
            elif parallel_state.rank == 0:
                logger.warning("the checkpoint was saved with data-parallel size %d and this run "
                               "uses %d: RNG states are not restored", len(rng_states),
                               parallel_state.dp_size)
        rerun_states = payload.get("rerun_state")
        return training_state_class(
            iteration=int(payload["iteration"]),
            consumed_train_samples=int(payload["consumed_train_samples"]),
            consumed_valid_samples=int(payload["consumed_valid_samples"]),
            rerun_state=(rerun_states[parallel_state.dp_rank] if rerun_states is not None
                         and len(rerun_states) == parallel_state.dp_size else None))




def _check_saved_states_are_present(path: str, payload: dict, checkpoint_config) -> None:
    """A checkpoint saved with --no-save-optim / --no-save-rng (the entry is None) loads only
    when this run does not ask for what it lacks; the error names the missing state and the flag."""
    if checkpoint_config.finetune or payload.get("weights_only"):
        return  # nothing but the weights is loaded (weights-only files are checked above)
    if payload["optimizer"] is None and not checkpoint_config.no_load_optim:
        raise CheckpointError(f"checkpoint file {path} holds no optimizer state (it was saved with "
                              f"--no-save-optim), so the optimizer and learning-rate schedule "
                              f"cannot be restored; pass --no-load-optim to start them afresh, "
                              f"or --finetune to load the weights only")
    if payload["rng_state"] is None and not checkpoint_config.no_load_rng:
        raise CheckpointError(f"checkpoint file {path} holds no RNG state (it was saved with "
                              f"--no-save-rng); pass --no-load-rng to continue with the random "
                              f"generators as seeded by --seed")


def publish_checkpoint(root: str, staging_dir: str, final_dir: str, header: dict, files: dict,
                       iteration: int) -> None:
    """After every rank wrote: ``metadata.json`` (``header`` and every file's size and CRC-32),
    fsyncs, the staging directory renamed into place, then the tracker. One rank calls it."""
    metadata = {**header, "files": dict(sorted(files.items()))}
    metadata_path = os.path.join(staging_dir, METADATA_FILENAME)
    with open(metadata_path, "w") as handle:
        json.dump(metadata, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    subdirectories = {os.path.dirname(os.path.join(staging_dir, name)) for name in files}
    for directory in subdirectories - {staging_dir}:  # the legacy layout's mp_rank_* folders
        _fsync_directory(directory)
    _fsync_directory(staging_dir)
    _move_into_place(staging_dir, final_dir)
    _fsync_directory(root)
    write_tracker(root, iteration)
    shutil.rmtree(final_dir + REPLACED_SUFFIX, ignore_errors=True)


def _move_into_place(staging_dir: str, final_dir: str) -> None:
    """Rename the staging directory to its final name. Re-saving an existing iteration moves the
    old copy aside first and deletes it only after the tracker is written (an interruption leaves
    it as ``iter_X.replaced``); a failed rename puts the old copy back."""
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
