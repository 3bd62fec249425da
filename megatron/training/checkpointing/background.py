"""``--async-save``: a torch_dist checkpoint written *and published* in the background.

What the training thread does at each background save (the only time training waits), with no
collective of its own:

1. wait for this rank's previous background save (normally long finished) and raise, on every
   rank alike, if it failed (its outcome was agreed in the background, see below);
2. remove what an interrupted save of the same iteration left under this rank's own file names;
   copy its state to CPU memory (:class:`.staging.StagingBuffers`);
3. hand the save to this rank's background thread (:class:`SaveJob`); return.

The background thread uses a gloo group of its own (:func:`background_group`, so its collectives
never interleave with training's). A rank whose local plan is the one the cached plans were made
for (:class:`PlanCache`) writes its file with its cached part of the global plan (rank 0 writes
DCP's ``.metadata`` from every rank's write results later); a rank whose plan is not (the first
save, a changed state) writes nothing. The thread then records this rank's files (size, CRC-32,
computed while writing) and gathers them, with whether its plan fitted, on rank 0 over the same
group. If some rank's plan did not fit, rank 0 says so in its broadcast, every rank removes what
it wrote and DCP's ``save`` plans (four collectives; its global planning also decides which rank
packs each small tensor, :class:`.dcp_io.PieceSavePlanner`) and writes, its plans are kept, and
the files are gathered again. A rank that could not copy its state enters DCP's save with a
planner that fails: DCP's own agreement then fails the save on every rank.

Only when every rank's write succeeded does rank 0 publish (``.metadata`` if still to write,
anything this save did not write removed, ``metadata.json``, rename, tracker); rank 0 then
broadcasts the outcome, so every rank's job ends with the same verdict. The tracker therefore
names a checkpoint only after every rank's write finished, and a rank killed during a background
save leaves the staging directory unpublished and the previous checkpoint, which the tracker
names, intact. The next save and the end of training (:meth:`BackgroundSaver.finish`) wait for
the job; a failure raises there on every rank.

With ``--use-persistent-ckpt-worker`` DCP's asynchronous save writes from a persistent process per
rank instead (it plans every save); the completion part is the same.

Before, the training thread did the waiting, the gather of files, rank 0's publishing (fsyncs and
renames) with its agreement, and agreements on the staging directory and on the copied state
(docs/checkpointing.md, "What --async-save costs"); every save paid DCP's planning; and later
a collective of its own agreed on reusing the plans before writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import io
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from megatron.training.checkpointing import torch_dist
from megatron.training.checkpointing.dcp_io import DCP_METADATA_FILENAME
from megatron.training.checkpointing.files import METADATA_FILENAME, _describe
from megatron.training.checkpointing.staging import StagingBuffers


@dataclasses.dataclass
class Outcome:
    """The verdict on one background save, the same on every rank: None, or why it failed; and
    rank 0's lines to log. ``replan``: a rank's cached save plan did not fit, nothing was
    published, every rank saves again through DCP's planning."""

    error: Optional[str] = None
    log_lines: list = dataclasses.field(default_factory=list)
    replan: bool = False


@dataclasses.dataclass
class PendingSave:
    """A background save in flight: its completion job's future resolves to the
    :class:`Outcome` once the checkpoint is published or abandoned."""

    future: Future
    iteration: int
    root: str
    staging_dir: str


def background_group(parallel_state):
    """A gloo group of every rank for DCP's collectives and the completion jobs', used only by
    the background (None in one process). With ``--use-persistent-ckpt-worker`` DCP starts one
    writer process per rank (at the first save, kept for the run), which forms its own group;
    this group sets it up and carries the completion jobs' collectives."""
    if torch_dist._no_dist(parallel_state):
        return None
    return dist.new_group(backend="gloo")


def stop_writer_process() -> None:
    """End DCP's persistent writer process (``--use-persistent-ckpt-worker``) at the end of
    training, so it leaves cleanly instead of finding its pipe closed when this process exits.
    DCP keeps the process in a private module attribute; nothing happens if it has none."""
    from torch.distributed.checkpoint import _async_process_executor as executor_module

    process = getattr(executor_module, "_CHECKPOINT_PROCESS", None)
    if process is not None:
        executor_module._CHECKPOINT_PROCESS = None
        process.__del__()  # sends TERMINATE and joins it (a no-op when collected later)


@dataclasses.dataclass
class PlanCache:
    """The DCP plans of this rank's last save that went through DCP's planning: while every rank's
    local plan is the same (same keys, boxes, dtypes and global shapes), a background save reuses
    them instead of planning again (DCP's planning costs four collectives per save)."""

    key: Optional[tuple] = None        # :meth:`.dcp_io.PieceSavePlanner.plan_key` it was made for
    central_plan: Optional[SavePlan] = None  # this rank's part of the global plan
    metadata: Optional[Metadata] = None      # rank 0: DCP's index, without storage_data

    def fits(self, key: Optional[tuple]) -> bool:
        return key is not None and self.central_plan is not None and key == self.key

    def packed_here(self) -> set:
        """The indices of the small pieces this rank packs under the cached plan."""
        packing = None if self.central_plan is None else self.central_plan.planner_data
        return {tuple(index) for index in packing[1]} if packing else set()

    def forget(self) -> None:
        self.key = self.central_plan = self.metadata = None

    def remember(self, key: Optional[tuple], planner) -> None:
        """After a save through DCP's planning: keep its plans (forget them if it had none)."""
        self.key, self.central_plan = key, planner.central_plan
        self.metadata = planner.global_metadata


def remove_own_leftovers(staging_dir: str, rank: int) -> None:
    """Remove the files this rank's writer left in ``staging_dir`` from an interrupted save of
    the same iteration (rank 0 also DCP's ``.metadata``). Only this rank's names: other ranks may
    be writing theirs already. What ranks that no longer exist left is removed when the save is
    published (:func:`_remove_unlisted`). Nothing to do, normally: the directory does not
    exist."""
    if not os.path.isdir(staging_dir):
        return
    leftovers = glob.glob(os.path.join(staging_dir, torch_dist.own_file_pattern(rank)))
    if rank == 0:
        leftovers += [os.path.join(staging_dir, name) for name in
                      (DCP_METADATA_FILENAME, METADATA_FILENAME)]
    for path in leftovers:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


class BackgroundSaver:
    """The background saves of one training run (held by the :class:`.Checkpointer`).

    Args:
        log: rank 0's progress lines.
        use_process_writer: ``--use-persistent-ckpt-worker``: DCP writes from a persistent
            writer process per rank instead of a thread of the training process.
    """

    def __init__(self, log: Callable[[str], None], use_process_writer: bool):
        self.log = log
        self.use_process_writer = use_process_writer
        self.pending: Optional[PendingSave] = None
        self._group = None
        self._group_ready = False
        self._jobs: Optional[ThreadPoolExecutor] = None
        self._staging = StagingBuffers()
        self._plans = PlanCache()
        self._config_dict: Optional[dict] = None  # the run's config, as every save records it
        self._serialized: dict = {}  # {"config": its torch.save bytes}, made at the first save
        self._pieces_kept = _KeptPieces()  # what the staged pieces give, while they are kept

    def start(self, components, state, checkpoint_config, root: str, staging_dir: str,
              publish: Callable[[dict], list]) -> None:
        """Wait for the previous save (raises on every rank if it failed), copy this rank's state
        and start writing it. Every rank calls it; no collective here. ``publish(files)`` runs on
        rank 0 in the background once every rank's write finished (metadata, rename, tracker)
        and returns the lines to log."""
        parallel_state = components.parallel_state
        rank = parallel_state.rank
        started = time.perf_counter()
        self.finish(parallel_state)
        error = None
        try:
            remove_own_leftovers(staging_dir, rank)
        except OSError as caught:
            error = f"preparing checkpoint directory {staging_dir}: {_describe(caught)}"
        pieces, objects = [], {}
        if error is None:
            if self._config_dict is None:
                self._config_dict = dataclasses.asdict(components.config)
                self._serialized = {"config": _serialize(self._config_dict)}
            pieces, objects, error = torch_dist.collect(
                components, state, checkpoint_config, copy=True, staging=self._staging,
                config_dict=self._config_dict, packed_here=self._plans.packed_here())
        if not self._group_ready:
            self._group = background_group(parallel_state)
            self._group_ready = True
        no_dist = torch_dist._no_dist(parallel_state)
        planner = self._pieces_kept.planner(parallel_state, self._staging.generation, pieces,
                                            objects, error, self._serialized)
        if self._jobs is None:
            self._jobs = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix="checkpoint-completion")
        save = SaveJob(rank, self._group, no_dist, staging_dir, publish)
        if self.use_process_writer and not no_dist:
            # DCP's writer process joins its peers through a process group: one process uses a
            # thread. It plans every save (its process holds no plans of ours).
            write = dcp.async_save({}, storage_writer=torch_dist.writer_for(staging_dir),
                                   planner=planner, process_group=self._group,
                                   async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            job = self._jobs.submit(save.complete, functools.partial(_wait_for, write))
        else:
            job = self._jobs.submit(save.write_and_complete, planner, self._plans)
        self.pending = PendingSave(job, state.iteration, root, staging_dir)
        if rank == 0:
            self.log(f"  writing checkpoint of iteration {state.iteration:7d} in the background "
                     f"(copied in {time.perf_counter() - started:.2f} s)")

    def finish(self, parallel_state, stop_writer: bool = False) -> None:
        """Wait for the background save in flight (if any); raises on every rank if it failed
        (the verdict is the same on every rank: no collective here). ``stop_writer``: the end of
        training, the persistent writer process (if any) and the completion thread stop too."""
        pending, self.pending = self.pending, None
        try:
            if pending is not None:
                try:
                    outcome = pending.future.result()
                except BaseException as caught:  # the job catches everything: its own crash
                    outcome = Outcome(f"its completion job failed: {_describe(caught)}")
                if outcome.error is not None:
                    raise RuntimeError(f"saving checkpoint at iteration {pending.iteration} to "
                                       f"{pending.root} in the background failed (the newest "
                                       f"published checkpoint and the tracker are unchanged): "
                                       f"{outcome.error}")
                if parallel_state.rank == 0:
                    for line in outcome.log_lines:
                        self.log(line)
        finally:
            if stop_writer:
                if self.use_process_writer:
                    stop_writer_process()
                if self._jobs is not None:
                    self._jobs.shutdown(wait=True)
                    self._jobs = None


@dataclasses.dataclass
class _KeptPieces:
    """What a background save derives from the staged pieces, kept while they are the same (the
    :class:`.staging.StagingBuffers` generation): their split into packed and unpacked (dicts by
    index), the packed objects (their buffers are the staged ones) and the local plan's key."""

    generation: int = -1
    split: Optional[tuple] = None
    packed_objects: dict = dataclasses.field(default_factory=dict)
    plan_keys: dict = dataclasses.field(default_factory=dict)  # object keys -> plan key

    def planner(self, parallel_state, generation: int, pieces: list, objects: dict,
                error: Optional[str], serialized: dict):
        """This save's planner (:func:`.torch_dist.planner_for`), from what is kept when the
        pieces are those of ``generation``."""
        if error is not None:
            return torch_dist.planner_for(parallel_state, pieces, objects, error,
                                          serialized=serialized)
        if generation != self.generation:
            packed, unpacked = torch_dist.split_packed(pieces)
            self.generation = generation
            self.split = ({piece.index: piece for piece in packed},
                          {piece.index: piece for piece in unpacked})
            self.packed_objects, self.plan_keys = {}, {}
        planner = torch_dist.planner_for(parallel_state, pieces, objects, serialized=serialized,
                                         split=self.split, packed_objects=self.packed_objects)
        object_keys = tuple(objects)
        if object_keys not in self.plan_keys:
            self.plan_keys[object_keys] = planner.plan_key()
        planner.known_plan_key = self.plan_keys[object_keys]
        return planner


@dataclasses.dataclass
class SaveJob:
    """The background part of one save on one rank (run by the completion thread). Never raises:
    the :class:`Outcome` says what failed, the same on every rank."""

    rank: int
    group: object
    no_dist: bool
    staging_dir: str
    publish: Callable[[dict], list]

    def write_and_complete(self, planner, plans: PlanCache) -> Outcome:
        """Write this rank's files, then :meth:`complete`. A rank whose local plan is the one
        ``plans`` were made for writes with its cached part of the global plan (rank 0 then
        writes DCP's ``.metadata`` from every rank's write results, gathered in
        :meth:`complete`); a rank whose plan is not (the first save, a changed state) writes
        nothing and says so in the same gather. If any rank said so, rank 0 publishes nothing
        and every rank removes what it wrote and saves through DCP's own planning (its
        collectives), and ``plans`` keep the new plans: a cached plan is used only when every
        rank's is, without a collective of its own."""
        try:
            key = planner.plan_key()
        except Exception:  # noqa: BLE001 - DCP's planning below fails with it on every rank
            key = None
        writer = torch_dist.writer_for(self.staging_dir)
        if plans.fits(key):
            outcome = self.complete(lambda: _write_planned(planner, writer, plans, self.rank),
                                    writer, plans.metadata, recorded_by=writer)
        elif self.no_dist:
            outcome = Outcome(replan=True)
        else:
            outcome = self.complete(None)
        if not outcome.replan:
            return outcome
        plans.forget()  # until this save's planning succeeds
        try:
            remove_own_leftovers(self.staging_dir, self.rank)  # written with the cached plan
        except OSError:
            pass  # the write below replaces the file, or fails naming it

        def plan_and_write():
            dcp.save({}, storage_writer=writer, planner=planner, process_group=self.group,
                     no_dist=self.no_dist)
            plans.remember(key, planner)
        return self.complete(plan_and_write, recorded_by=writer)

    def complete(self, write: Optional[Callable[[], object]], writer=None, metadata=None,
                 recorded_by=None) -> Outcome:
        """``write()`` this rank's files, record them (size, CRC-32) and gather every rank's on
        rank 0 over ``group``; rank 0 publishes when all succeeded (else removes the staging
        directory) and broadcasts the outcome. ``write()`` returns this rank's DCP write results
        when rank 0 still has to write DCP's ``.metadata`` (with ``writer``, from ``metadata``),
        else None (DCP's save wrote it). ``write`` None: this rank's cached plan does not fit,
        it wrote nothing, and the outcome (on every rank) is to plan again. ``recorded_by``:
        the writer whose records of the files it wrote give their sizes and CRC-32s
        (:func:`.torch_dist.own_files`; else they are read back)."""
        error, files, results = None, {}, None
        if write is not None:
            try:
                results = write()
                files = torch_dist.own_files(self.staging_dir, self.rank,
                                             with_dcp_metadata=results is None,
                                             writer=recorded_by)
            except (Exception, CheckpointException) as caught:
                error = torch_dist.describe_failure(caught)
        if self.no_dist:
            return self._publish([(error, files, results, write is None)], writer, metadata)
        try:
            gathered = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
            dist.gather_object((error, files, results, write is None), gathered, dst=0,
                               group=self.group)
            verdict = self._publish(gathered, writer, metadata) if self.rank == 0 else None
            return _broadcast_outcome(verdict, self.group)
        except Exception as caught:  # a peer died or the group failed: this rank's own verdict
            return Outcome(f"agreeing on the written files: {_describe(caught)}")

    def _publish(self, gathered: list, writer, metadata) -> Outcome:
        """Rank 0: nothing when a rank must plan again; else DCP's ``.metadata`` (when the ranks
        wrote with a cached plan), then :func:`_publish_if_written`."""
        if any(must_plan for _, _, _, must_plan in gathered):
            return Outcome(replan=True)
        if writer is not None and not any(message for message, _, _, _ in gathered):
            try:
                writer.finish(metadata=metadata,
                              results=[results for _, _, results, _ in gathered])
                path = os.path.join(self.staging_dir, DCP_METADATA_FILENAME)
                gathered[0][1][DCP_METADATA_FILENAME] = torch_dist.file_record(path)
            except Exception as caught:
                gathered[0] = (f"writing {DCP_METADATA_FILENAME}: {_describe(caught)}",) + \
                    tuple(gathered[0][1:])
        return _publish_if_written([(message, files) for message, files, _, _ in gathered],
                                   self.staging_dir, self.publish)


def _broadcast_outcome(outcome: Optional[Outcome], group) -> Outcome:
    """Rank 0's ``outcome`` on every rank of ``group`` (others pass None): one broadcast of two
    numbers (success, plan again or failure; the message's length), a second one of the message
    only after a failure. The log lines stay on rank 0, which logs them."""
    header = torch.zeros(2, dtype=torch.int64)
    message = b""
    if outcome is not None:
        message = (outcome.error or "").encode()
        header[0] = 2 if outcome.error is not None else int(outcome.replan)
        header[1] = len(message)
    dist.broadcast(header, src=0, group=group)
    if outcome is not None:
        if header[1]:
            dist.broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), src=0,
                           group=group)
        return outcome
    code, length = header.tolist()
    if code == 2:
        text = torch.empty(length, dtype=torch.uint8)
        if length:
            dist.broadcast(text, src=0, group=group)
        return Outcome(text.numpy().tobytes().decode(errors="replace"))
    return Outcome(replan=code == 1)


def _serialize(value) -> bytes:
    """``torch.save`` of ``value``, as DCP writes an object."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _wait_for(write: Future) -> None:
    """Wait for DCP's asynchronous save (it wrote ``.metadata`` itself)."""
    write.result()


def _write_planned(planner, writer, plans: PlanCache, rank: int) -> list:
    """This rank's DCP write with its cached part of the global plan (what DCP's save does after
    planning: the planner packs its boxes, the writer writes one file); returns the write
    results for rank 0's ``.metadata``."""
    planner.set_up_planner({}, is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    plan = writer.prepare_local_plan(planner.finish_plan(plans.central_plan))
    written = writer.write_data(plan, planner)
    written.wait()
    return written.value()


def _publish_if_written(gathered: list, staging_dir: str,
                        publish: Callable[[dict], list]) -> Outcome:
    """Rank 0: publish when every rank's write succeeded (after removing what the directory holds
    besides this save's files), else remove the staging directory."""
    failures = [f"rank {index}: {message}" for index, (message, _) in enumerate(gathered)
                if message]
    if failures:
        shutil.rmtree(staging_dir, ignore_errors=True)
        return Outcome(f"failed on {len(failures)} rank(s): {'; '.join(failures)}")
    try:
        files = {name: record for _, entries in gathered for name, record in entries.items()}
        _remove_unlisted(staging_dir, files)
        lines = publish(files)
    except Exception as caught:
        shutil.rmtree(staging_dir, ignore_errors=True)
        return Outcome(f"publishing failed: {_describe(caught)}")
    return Outcome(None, list(lines))


def _remove_unlisted(staging_dir: str, files: dict) -> None:
    """Remove from ``staging_dir`` what this save did not write (an interrupted save of the same
    iteration by ranks that no longer exist), once every rank's write finished."""
    for entry in os.scandir(staging_dir):
        if entry.name in files or entry.name == METADATA_FILENAME:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.remove(entry.path)
