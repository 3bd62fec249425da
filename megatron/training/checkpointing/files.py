"""Checkpoint files on disk: names and paths, the tracker, CRC-32s, reading and writing files and
``metadata.json``. Pure file handling, no process groups (see the package docstring for the layout).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Optional

import torch

try:  # ISA-L's CRC-32: zlib's checksum, about 9x faster here (the optional ``isal`` package)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - without it, zlib's
    from zlib import crc32

CHECKPOINT_FORMAT = "megatron-chimera"
CHECKPOINT_FORMAT_VERSION = 1
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_FILENAME = "model_optim_rng.pt"
METADATA_FILENAME = "metadata.json"
STAGING_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"
NO_CHECKPOINT_MESSAGE = "no checkpoint found, starting from scratch"
_CRC_BLOCK = 1 << 22


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ----------------------------------------------------------------------------------------------
# Names and paths
# ----------------------------------------------------------------------------------------------

def iteration_dir_name(iteration: int) -> str:
    """Megatron's directory name of an iteration: ``iter_0000100``."""
    return f"iter_{iteration:07d}"


def fresh_staging_dir(root: str, iteration: int, error: type = ValueError) -> tuple[str, str]:
    """(final, staging) directories for writing ``iteration`` under ``root`` outside training
    (conversion, weights-only checkpoints): an existing final directory is refused with ``error``,
    a staging directory left by an interrupted writer is cleared."""
    final_dir = os.path.join(root, iteration_dir_name(iteration))
    if os.path.exists(final_dir):
        raise error(f"{final_dir} already exists; choose an empty --save directory")
    staging_dir = final_dir + STAGING_SUFFIX
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(staging_dir, ignore_errors=True)
    return final_dir, staging_dir


@contextlib.contextmanager
def published_iteration_dir(root: str, iteration: int, error: type = ValueError):
    """Write ``iteration`` under ``root`` outside training: yields the (final, staging)
    directories of :func:`fresh_staging_dir`; when the block ends the staging directory is
    renamed to the final one and the tracker written; when it raises, the staging directory is
    removed and nothing is published."""
    final_dir, staging_dir = fresh_staging_dir(root, iteration, error)
    try:
        yield final_dir, staging_dir
        os.replace(staging_dir, final_dir)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    write_tracker(root, iteration)


def empty_staging_dir(root: str, staging_dir: str) -> None:
    """Create ``root`` and an empty ``staging_dir`` in it, removing what a crashed save left
    (raises OSError). Another rank's DCP thread may already have created it, empty."""
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(staging_dir, ignore_errors=True)
    os.makedirs(staging_dir, exist_ok=True)


def weights_only_note(converted_from: Optional[str]) -> str:
    """The line rank 0 logs when a weights-only checkpoint (tools/convert_checkpoint.py) loads."""
    return (f"  the checkpoint holds weights only (converted from "
            f"[{converted_from or 'another layout'}]): the optimizer, LR schedule and RNG states "
            f"start afresh")


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
            crc = crc32(block, crc)
    return crc



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
