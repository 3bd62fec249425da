"""torch.distributed.checkpoint (DCP) underneath ``--ckpt-format torch_dist``: planners that write
and read :class:`~.global_keys.Piece` boxes of global tensors, and a reader that checks every file's
size and CRC-32 before DCP reads from it.

- :class:`PieceSavePlanner` turns this rank's pieces (and picklable objects) into DCP write items,
  one per box with its global offsets and the global shape. DCP's global planning drops boxes that
  several ranks hold (Chimera's stage replicas, tensor-parallel replicas, tied embedding copies)
  so that exactly one rank writes each, and rejects boxes that overlap or do not cover a tensor.
- :class:`PieceLoadPlanner` asks DCP for the boxes this rank needs, whatever boxes the checkpoint
  was saved in (DCP computes the overlaps: that is the resharding), and reads into them.
- :class:`VerifyingReader` verifies a file against ``metadata.json`` the first time it is read, so
  a truncated or flipped file fails with a message naming it instead of loading wrong numbers.
- :func:`single_process_dcp` silences DCP's "assuming the intent is to ... in a single process"
  warning around the calls that read or write in one process on purpose (``no_dist=True``).
- :class:`ChecksummingFileSystem` records the size and CRC-32 of every file DCP's writer writes,
  from the bytes as they are written (what ``metadata.json`` records, without reading the file
  back).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import warnings
from typing import Iterator, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed._shard._utils import narrow_tensor_by_index

from megatron.training.checkpointing.files import CheckpointError, _verify_file, crc32

# The start of the UserWarning torch.distributed.checkpoint's load and save give for no_dist=True.
SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Around a DCP load or save that runs in this process alone on purpose (``no_dist=True``: a
    one-process run, or each rank reading the small packed tensors itself): silence the warning
    that DCP "assumes" so, which every rank printed at every resume. Other warnings pass. Use it
    on the main thread only (``warnings.catch_warnings`` is not thread-safe)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
        yield

DCP_METADATA_FILENAME = ".metadata"  # written by DCP's FileSystemWriter


def _owns_storage(tensor: torch.Tensor) -> bool:
    return tensor.is_contiguous() and tensor.storage_offset() == 0 and \
        tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


class PieceSavePlanner(DefaultSavePlanner):
    """Write ``pieces`` (a :class:`~.global_keys.PieceSet`, a list of pieces, or a dict of them
    by index) and ``objects`` (``{key: picklable value}``, saved with ``torch.save``).

    ``packed`` (small pieces) travel as ONE object of this rank, ``packed_key``: one buffer per
    dtype and an index (:func:`pack_boxes`; DCP pays about a millisecond per item it writes). Which rank
    packs a box several ranks hold (Chimera's stage replicas, tensor- or data-parallel replicas)
    is decided in DCP's global planning, which already gathers every rank's plan: the lowest rank
    holding it, so each box is saved once, as DCP does for the large ones. ``error`` (a message)
    makes this rank's local planning fail, so every rank's save fails with it inside DCP's own
    agreement instead of this rank leaving its peers waiting in DCP's collectives.
    ``serialized`` (``{key: bytes}``): objects already ``torch.save``-d (a background save keeps
    the run's config so from save to save), written as they are. ``packed_objects``: a dict the
    caller keeps while the packed pieces are the same objects in the same buffers (a background
    save's staged pieces), ``{this rank's boxes: packed object}``: a packed object that copied
    nothing (its buffers are the pieces' own) is kept there and reused. ``known_plan_key``: what
    :meth:`plan_key` returns, when the caller knows it from an earlier save of the same
    pieces and object keys."""

    def __init__(self, pieces, objects: dict, *, packed=(), packed_key: Optional[str] = None,
                 error: Optional[str] = None, serialized: Optional[dict] = None,
                 packed_objects: Optional[dict] = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = _by_index(pieces)
        self.objects = dict(objects)
        self.packed = _by_index(packed)
        self.packed_key = packed_key
        self.error = error
        self.serialized = dict(serialized or {})
        self.packed_objects = packed_objects
        self.known_plan_key: Optional[tuple] = None
        self.central_plan: Optional[SavePlan] = None  # this rank's part of the global plan
        self.global_metadata = None  # the coordinator's: DCP's index of the checkpoint
        if self.packed and not packed_key:
            raise ValueError("PieceSavePlanner: packed pieces need a packed_key")

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False):
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        if self.error is not None:
            raise CheckpointError(self.error)
        items = []
        for (key, offsets), piece in self.pieces.items():
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                               sizes=piece.tensor.size()),
                    properties=TensorProperties.create_from_tensor(piece.tensor),
                    size=torch.Size(piece.global_shape))))
        for key in self.objects:
            if key != self.packed_key:  # (finish_plan adds it: a planner that planned before)
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        packing = None
        if self.packed:
            items.append(WriteItem(index=MetadataIndex(self.packed_key),
                                   type=WriteItemType.BYTE_IO))
            packing = (self.packed_key,
                       [(index, piece.tensor.numel() * piece.tensor.element_size())
                        for index, piece in self.packed.items()])
        self.plan = SavePlan(items, planner_data=packing)
        return self.plan

    def create_global_plan(self, all_plans: list):
        """Assign each packed box to one rank holding it: the one packing the fewest bytes so far
        (ties: the lowest rank), so that Chimera's two replicas of a stage share its writing; a
        rank that packs nothing writes no packed object. Then DCP's own global planning."""
        holders: dict = {}
        for rank, plan in enumerate(all_plans):
            for index, size in (plan.planner_data or (None, ()))[1]:
                holders.setdefault(index, (size, []))[1].append(rank)
        load = [0] * len(all_plans)
        owner = {}
        for index, (size, ranks) in holders.items():
            owner[index] = min(ranks, key=lambda rank: (load[rank], rank))
            load[owner[index]] += size
        assigned = []
        for rank, plan in enumerate(all_plans):
            if plan.planner_data is None:
                assigned.append(plan)
                continue
            key, boxes = plan.planner_data
            mine = [index for index, _ in boxes if owner[index] == rank]
            items = plan.items if mine else \
                [item for item in plan.items if item.index.fqn != key]
            assigned.append(dataclasses.replace(plan, items=items, planner_data=(key, mine)))
        plans, self.global_metadata = super().create_global_plan(assigned)
        return plans, self.global_metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """This rank's packed object: the boxes the global plan assigned to it
        (:func:`pack_boxes`)."""
        self.central_plan = new_plan  # what a later save of the same plan reuses (background)
        if new_plan.planner_data is not None and new_plan.planner_data[1]:
            key, mine = new_plan.planner_data
            boxes = tuple(tuple(index) for index in mine)
            packed = None if self.packed_objects is None else self.packed_objects.get(boxes)
            if packed is None:
                packed, copied = _pack(self.packed[index] for index in boxes)
                if self.packed_objects is not None and not copied:
                    self.packed_objects[boxes] = packed
            self.objects[key] = packed
        return super().finish_plan(new_plan)

    def plan_key(self) -> Optional[tuple]:
        """What this rank's local plan consists of (every item's key, box, dtype and global
        shape, and the packed boxes), to tell whether a global plan made for an earlier save
        still fits; None when this rank cannot save (``error``)."""
        if self.error is not None:
            return None
        if self.known_plan_key is not None:
            return self.known_plan_key
        plan = self.create_local_plan()
        items = tuple((item.index.fqn, None if item.index.offset is None
                       else tuple(item.index.offset), item.type.value,
                       None if item.tensor_data is None else
                       (tuple(item.tensor_data.chunk.sizes), str(item.tensor_data.properties.dtype),
                        tuple(item.tensor_data.size))) for item in plan.items)
        packing = None if plan.planner_data is None else \
            (plan.planner_data[0], tuple(plan.planner_data[1]))
        return items, packing

    def transform_object(self, write_item: WriteItem, object):
        if write_item.type == WriteItemType.BYTE_IO and write_item.index.fqn in self.serialized:
            return io.BytesIO(self.serialized[write_item.index.fqn])
        if write_item.type == WriteItemType.BYTE_IO and write_item.index.fqn == self.packed_key:
            return io.BytesIO(raw_packed_bytes(object))
        return super().transform_object(write_item, object)

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.objects and index.offset is None:
            return self.objects[index.fqn]
        # torch.save of a view writes its whole storage (a flat buffer): save a compact copy
        return _compact(self.pieces[(index.fqn, tuple(index.offset))].tensor)


def _by_index(pieces) -> dict:
    """``{piece.index: piece}``; a dict of that form (kept by the caller from save to save, never
    changed here) is used as it is."""
    return pieces if isinstance(pieces, dict) else {piece.index: piece for piece in pieces}


def pack_boxes(pieces) -> dict:
    """A packed object: ``{"buffers": [one flat tensor per dtype], "boxes": JSON text of [[key,
    global shape, offsets, sizes, buffer number, start], ...]}``. ``torch.save`` pays per tensor
    it pickles (tens of microseconds each: most of a small model's save), so the boxes travel as
    one buffer per dtype and an index; and it pays a few microseconds per Python object it
    pickles (its ``persistent_id`` hook runs for each), so the index is one string."""
    return _pack(pieces)[0]


def _pack(pieces) -> tuple[dict, bool]:
    """:func:`pack_boxes`, and whether it copied the pieces (else its buffers are theirs)."""
    groups: dict = {}
    copied = False
    for piece in pieces:
        groups.setdefault(piece.tensor.dtype, []).append(piece)
    buffers, boxes = [], []
    for number, group in enumerate(groups.values()):
        start = 0
        for piece in group:
            boxes.append((piece.key, list(piece.global_shape), list(piece.offsets),
                          list(piece.tensor.shape), number, start))
            start += piece.tensor.numel()
        tensors = [piece.tensor.detach() for piece in group]
        joined = _joined(tensors)
        copied = copied or joined is None
        buffers.append(torch.cat([tensor.reshape(-1) for tensor in tensors]) if joined is None
                       else joined)
    return {"buffers": buffers, "boxes": json.dumps(boxes, separators=(",", ":"))}, copied


def _joined(tensors: list) -> Optional[torch.Tensor]:
    """The flat tensor that ``tensors`` are consecutive contiguous views of, in order, covering
    all of its storage (staged so by :class:`.staging.StagingBuffers`); None if they are not."""
    storage = tensors[0].untyped_storage()
    start = 0
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.storage_offset() != start or \
                tensor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        start += tensor.numel()
    if start * tensors[0].element_size() != storage.nbytes():
        return None
    return torch.empty(0, dtype=tensors[0].dtype).set_(storage, 0, (start,))


#: What a packed object written as it is (:func:`raw_packed_bytes`) begins with; a ``torch.save``
#: (the packed objects of checkpoints written before) begins with a zip header instead.
RAW_PACKED_MAGIC = b"megatron-chimera packed boxes v1\n"


def raw_packed_bytes(packed: dict) -> bytes:
    """A packed object (:func:`pack_boxes`) as DCP writes it: :data:`RAW_PACKED_MAGIC`, the
    header's length (8 bytes, little-endian), the header (JSON: the boxes' index and each
    buffer's dtype and length), then each buffer's bytes. ``torch.save`` would copy the buffers
    into a zip record and compute that record's CRC-32 (which torch's reader does not check;
    the file's own CRC-32 in ``metadata.json`` covers these bytes): about four times the CPU."""
    buffers = [buffer.detach().contiguous().reshape(-1) for buffer in packed["buffers"]]
    header = json.dumps({"boxes": packed["boxes"],
                         "buffers": [[str(buffer.dtype).removeprefix("torch."), buffer.numel()]
                                     for buffer in buffers]},
                        separators=(",", ":")).encode()
    return b"".join([RAW_PACKED_MAGIC, len(header).to_bytes(8, "little"), header,
                     *(buffer.view(torch.uint8).numpy().data for buffer in buffers)])


def read_raw_packed(data: bytes) -> dict:
    """Inverse of :func:`raw_packed_bytes`: ``{"buffers": [...], "boxes": JSON text}``."""
    start = len(RAW_PACKED_MAGIC)
    length = int.from_bytes(data[start:start + 8], "little")
    header = json.loads(data[start + 8:start + 8 + length])
    position = start + 8 + length
    buffers = []
    for dtype_name, numel in header["buffers"]:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"a packed object names the unknown dtype {dtype_name!r}")
        size = numel * dtype.itemsize
        if position + size > len(data):
            raise CheckpointError("a packed object is shorter than its header says")
        raw = bytearray(data[position:position + size])
        buffers.append(torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if size
                       else torch.empty(0, dtype=dtype))
        position += size
    return {"buffers": buffers, "boxes": header["boxes"]}


def unpack_boxes(packed) -> list:
    """``[(key, global shape, offsets, tensor), ...]`` of a packed object: :func:`pack_boxes`'s
    form (its index JSON text, or a list in checkpoints written before), or the list of one
    tensor per box that checkpoints written before either hold."""
    if isinstance(packed, list):
        return packed
    buffers, boxes = packed["buffers"], packed["boxes"]
    if isinstance(boxes, str):
        boxes = json.loads(boxes)
    return [(key, shape, offsets, buffers[number][start:start + math.prod(sizes)].view(sizes))
            for key, shape, offsets, sizes, number, start in boxes]


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with storage of its own (torch.save of a view writes the whole storage)."""
    tensor = tensor.detach()
    return tensor if _owns_storage(tensor) else tensor.clone()


class PieceLoadPlanner(DefaultLoadPlanner):
    """Read the checkpoint's boxes that overlap ``pieces`` into them, and ``object_keys`` (with
    ``torch.load(weights_only=True)``) into :attr:`objects`."""

    def __init__(self, pieces, object_keys):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {piece.index: piece for piece in pieces}
        self.object_keys = list(object_keys)
        self.objects: dict = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False):
        self.state_dict = {}
        self.original_state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items = []
        for (key, offsets), piece in self.pieces.items():
            entry = saved.get(key)
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint holds no tensor {key!r}")
            items += create_read_items_for_chunk_list(
                key, entry, [ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                  sizes=piece.tensor.size())])
        for key in self.object_keys:
            if not isinstance(saved.get(key), BytesStorageMetadata):
                raise CheckpointError(f"the checkpoint holds no entry {key!r}")
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)),
                                  storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        is_raw_packed = value.read(len(RAW_PACKED_MAGIC)) == RAW_PACKED_MAGIC
        value.seek(0)
        if is_raw_packed:  # a packed object written as it is
            self.objects[read_item.dest_index.fqn] = read_raw_packed(value.getvalue())
            return
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem):
        piece = self.pieces[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return narrow_tensor_by_index(piece.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def fill_copies(self) -> None:
        """After loading: every other local tensor of a box gets the box's values."""
        for piece in self.pieces.values():
            for copy in piece.copies:
                copy.copy_(piece.tensor)


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks each file against ``files`` (``{relative path: {size,
    crc32}}`` from ``metadata.json``) before reading it."""

    def __init__(self, path: str, files: dict):
        super().__init__(path)
        self.directory = path
        self.files = files
        self.verified: set = set()

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(self.directory, DCP_METADATA_FILENAME)
        self._verify(DCP_METADATA_FILENAME)
        try:
            return super().read_metadata(*args, **kwargs)
        except Exception as error:
            raise CheckpointError(f"checkpoint file {path} cannot be read ({error}); it is "
                                  f"corrupt: load an older iteration or save again") from None

    def read_data(self, plan: LoadPlan, planner):
        for item in plan.items:
            self._verify(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)

    def _verify(self, relative: str) -> None:
        if relative in self.verified:
            return
        recorded = self.files.get(relative)
        path = os.path.join(self.directory, relative)
        if recorded is None:
            raise CheckpointError(f"checkpoint file {path} is not listed in the checkpoint's "
                                  f"metadata.json; the checkpoint is incomplete or mixed up")
        _verify_file(path, recorded)
        self.verified.add(relative)


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording in :attr:`written` (``{path: {size, crc32}}``) each
    file it wrote completely, its CRC-32 computed from the bytes as they were written."""

    def __init__(self):
        super().__init__()
        self.written: dict = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            checksummed = _ChecksummingStream(stream)
            yield checksummed
            self.written[os.path.normpath(path)] = {"size": checksummed.size,
                                                    "crc32": checksummed.crc32}


class _ChecksummingStream:
    """A binary file being written, with the size and CRC-32 of what was written to it."""

    def __init__(self, raw):
        self._raw = raw
        self.size = 0
        self.crc32 = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc32 = crc32(view, self.crc32)
        self.size += view.nbytes
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    def writable(self) -> bool:
        return True
