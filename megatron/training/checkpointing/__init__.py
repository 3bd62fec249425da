"""Megatron-style checkpoints: save, load and exact resume of a training run.

Two formats (``--ckpt-format``; loading detects the one it finds): ``torch_dist``, the default as in
Megatron-LM — global tensors through torch.distributed.checkpoint, resumable in any layout
(:mod:`.torch_dist`, :mod:`.global_keys`, :mod:`.dcp_io`) — and ``torch``, Megatron's legacy
layout described below.

Legacy layout on disk (``--ckpt-format torch``, shared by every rank of the job)::

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
A checkpoint of a different parallel layout (TP, PP, schedule, chunks per rank), or a
distributed-optimizer one at another data-parallel size, is read through the global keys of
:mod:`.global_keys`, optimizer state included (:mod:`.resharding`: the files record their optimizer
state by parameter name); per-rank RNG and gradient-reducer states then start afresh, with a note.
``tools/convert_checkpoint.py`` (:mod:`megatron.training.checkpoint_conversion`) writes a
weights-only copy (``"weights_only": True``) that loads with ``--finetune`` or ``--no-load-optim``.
The data-parallel size may change (weights and optimizer state are replicated over data-parallel
ranks); RNG states are then not restored, with a warning.

Before the first iteration :func:`check_checkpoint_directories` refuses to start afresh over
existing checkpoints (``--allow-overwrite-checkpoints`` permits it) and checks that ``--save`` is
writable.

Modules: :mod:`.files` (paths, tracker, file I/O), :mod:`.state` (layout, RNG, compatibility
checks), :mod:`.collectives` (agreement between ranks), :mod:`.checkpointer` (the hook),
:mod:`.guard` (checks before training), :mod:`.background` and :mod:`.staging`
(``--async-save``). The public names are re-exported here.
"""

from megatron.training.checkpointing.checkpointer import Checkpointer
from megatron.training.checkpointing.files import (CHECKPOINT_FILENAME, CHECKPOINT_FORMAT,
                                                  CHECKPOINT_FORMAT_VERSION, METADATA_FILENAME,
                                                  NO_CHECKPOINT_MESSAGE, REPLACED_SUFFIX,
                                                  STAGING_SUFFIX, TRACKER_FILENAME,
                                                  CheckpointError, _read_metadata,  # noqa: F401
                                                  _verify_file,  # noqa: F401 (re-exported)
                                                  checkpoint_file, file_crc32, iteration_dir_name,
                                                  load_file, model_keys, rank_dir_name,
                                                  read_tracker, save_file, write_tracker)
from megatron.training.checkpointing.guard import (check_checkpoint_directories,
                                                  check_no_overwrite, check_save_writable,
                                                  saved_iterations)
from megatron.training.checkpointing.state import (ARCHITECTURE_FLAGS, capture_rng_state,
                                                  describe_layout, parallel_layout,
                                                  restore_rng_state)

__all__ = [
    "ARCHITECTURE_FLAGS", "CHECKPOINT_FILENAME", "CHECKPOINT_FORMAT", "CHECKPOINT_FORMAT_VERSION",
    "METADATA_FILENAME", "NO_CHECKPOINT_MESSAGE", "REPLACED_SUFFIX", "STAGING_SUFFIX",
    "TRACKER_FILENAME", "CheckpointError", "Checkpointer", "capture_rng_state",
    "check_checkpoint_directories", "check_no_overwrite", "check_save_writable",
    "checkpoint_file", "describe_layout", "file_crc32", "iteration_dir_name", "load_file",
    "model_keys", "parallel_layout", "rank_dir_name", "read_tracker", "restore_rng_state",
    "save_file", "saved_iterations", "write_tracker",
]
