"""``--async-save``: a torch_dist checkpoint written *and published* in the background.

What the training thread does at each background save (the only time training waits), with no
collective of its own:

1. wait for this rank's previous background save (normally long finished) and raise, on every
   rank alike, if it failed (its outcome was agreed in the background, see below);
2. rank 0 empties the staging directory; every rank copies its state to CPU memory;
3. start DCP's ``async_save`` into the staging directory, and a completion job; return.

DCP's save runs its planning and metadata collectives on a gloo group of their own
(:func:`background_group`, so they never interleave with training's), and its global planning
also decides which rank packs each small tensor (:class:`.dcp_io.PieceSavePlanner`). A rank that
could not copy its state, or a rank 0 that could not prepare the staging directory, enters DCP's
save with a planner that fails: DCP's own agreement then fails the save on every rank.

The completion job (one thread per rank, kept for the run) waits for DCP's write, records this
rank's files (size, CRC-32) and gathers them on rank 0 over the same group; only when every
rank's write succeeded does rank 0 publish (``metadata.json``, rename, tracker); rank 0 then
broadcasts the outcome, so every rank's job ends with the same verdict. The tracker therefore
names a checkpoint only after every rank's write finished, and a rank killed during a background
save leaves the staging directory unpublished and the previous checkpoint, which the tracker
names, intact. The next save and the end of training (:meth:`BackgroundSaver.finish`) wait for
the job; a failure raises there on every rank.

Before, the training thread did the waiting, the gather of files, rank 0's publishing (fsyncs and
renames) with its agreement, and agreements on the staging directory and on the copied state:
four collectives and the publishing on the critical path of every save (docs/checkpointing.md,
"What --async-save costs").
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from megatron.training.checkpointing import torch_dist
from megatron.training.checkpointing.files import _describe, empty_staging_dir
from megatron.training.checkpointing.staging import StagingBuffers


@dataclasses.dataclass
class Outcome:
    """The verdict on one background save, the same on every rank: None, or why it failed; and
    rank 0's lines to log."""

    error: Optional[str] = None
    log_lines: list = dataclasses.field(default_factory=list)


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


def _fresh_staging_dir(root: str, staging_dir: str) -> Optional[str]:
    """Rank 0: an empty staging directory (removing what a crashed save left); None or why not.
    No rank writes into it before rank 0's DCP save has started (DCP's global planning, on rank
    0, comes first), but another rank's DCP thread may already have created it (empty)."""
    try:
        empty_staging_dir(root, staging_dir)
    except OSError as caught:
        return f"preparing checkpoint directory {staging_dir}: {_describe(caught)}"
    return None


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
        self._config_dict: Optional[dict] = None  # the run's config, as every save records it

    def start(self, components, state, checkpoint_config, root: str, staging_dir: str,
              publish: Callable[[dict], list]) -> None:
        """Wait for the previous save (raises on every rank if it failed), copy this rank's state
        and start writing it. Every rank calls it; no collective here. ``publish(files)`` runs on
        rank 0 in the background once every rank's write finished (metadata, rename, tracker)
        and returns the lines to log."""
        parallel_state = components.parallel_state
        started = time.perf_counter()
        self.finish(parallel_state)
        error = _fresh_staging_dir(root, staging_dir) if parallel_state.rank == 0 else None
        pieces, objects = [], {}
        if error is None:
            if self._config_dict is None:
                self._config_dict = dataclasses.asdict(components.config)
            pieces, objects, error = torch_dist.collect(
                components, state, checkpoint_config, copy=True, staging=self._staging,
                config_dict=self._config_dict)
        if not self._group_ready:
            self._group = background_group(parallel_state)
            self._group_ready = True
        no_dist = torch_dist._no_dist(parallel_state)
        # DCP's writer process joins its peers through a process group: one process uses a thread
        executor = AsyncCheckpointerType.PROCESS if self.use_process_writer and not no_dist \
            else AsyncCheckpointerType.THREAD
        write = dcp.async_save({}, storage_writer=torch_dist.writer_for(staging_dir),
                               planner=torch_dist.planner_for(parallel_state, pieces, objects,
                                                              error),
                               process_group=self._group, no_dist=no_dist,
                               async_checkpointer_type=executor)
        if self._jobs is None:
            self._jobs = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix="checkpoint-completion")
        job = self._jobs.submit(_complete, write, parallel_state.rank, self._group, no_dist,
                                staging_dir, publish)
        self.pending = PendingSave(job, state.iteration, root, staging_dir)
        if parallel_state.rank == 0:
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


def _complete(write: Future, rank: int, group, no_dist: bool, staging_dir: str,
              publish: Callable[[dict], list]) -> Outcome:
    """The completion job of one background save (a thread of its own): wait for this rank's DCP
    write, record its files, gather every rank's on rank 0 over ``group``; rank 0 publishes when
    all succeeded (else removes the staging directory) and broadcasts the outcome. Never raises:
    the :class:`Outcome` says what failed."""
    error, files = None, {}
    try:
        write.result()
        files = torch_dist.own_files(staging_dir, rank)
    except (Exception, CheckpointException) as caught:
        error = torch_dist.describe_failure(caught)
    if no_dist:
        return _publish_if_written([(error, files)], staging_dir, publish)
    try:
        gathered = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object((error, files), gathered, dst=0, group=group)
        verdict = [_publish_if_written(gathered, staging_dir, publish) if rank == 0 else None]
        dist.broadcast_object_list(verdict, src=0, group=group)
    except Exception as caught:  # a peer died or the group failed: this rank's own verdict
        return Outcome(f"agreeing on the written files: {_describe(caught)}")
    return verdict[0]


def _publish_if_written(gathered: list, staging_dir: str,
                        publish: Callable[[dict], list]) -> Outcome:
    """Rank 0: publish when every rank's write succeeded, else remove the staging directory."""
    failures = [f"rank {index}: {message}" for index, (message, _) in enumerate(gathered)
                if message]
    if failures:
        shutil.rmtree(staging_dir, ignore_errors=True)
        return Outcome(f"failed on {len(failures)} rank(s): {'; '.join(failures)}")
    try:
        lines = publish({name: record for _, entries in gathered
                         for name, record in entries.items()})
    except Exception as caught:
        shutil.rmtree(staging_dir, ignore_errors=True)
        return Outcome(f"publishing failed: {_describe(caught)}")
    return Outcome(None, list(lines))
