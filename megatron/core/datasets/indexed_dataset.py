"""Megatron's indexed dataset: a ``PREFIX.bin`` of token ids and a ``PREFIX.idx`` describing them.

This module owns the on-disk format, byte for byte as Megatron-LM writes it, so data preprocessed by
Megatron's own tools is read here unchanged and data written here is read by Megatron.

``.idx`` layout (little-endian)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version = 1
    uint8     dtype code of the .bin tokens (see ``DTYPE_CODES``)
    uint64    sequence count S
    uint64    document-index count D + 1
    int32[S]  sequence lengths in tokens
    int64[S]  sequence byte offsets into .bin
    int64[D+1] document boundaries in sequences, starting at 0 and ending at S

``.bin`` holds every sequence's tokens back to back in the one dtype.

:class:`IndexedDataset` memory-maps both files and validates them (magic, version, dtype, sizes,
offsets) so a corrupt, truncated or mismatched pair fails on open with a message naming the file.
:class:`IndexedDatasetBuilder` writes the pair.
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, Optional

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's dtype codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
# magic + version + dtype code + sequence count + document-index count
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8


def data_file_path(path_prefix: str) -> str:
    """The ``.bin`` file of a dataset prefix."""
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    """The ``.idx`` file of a dataset prefix."""
    return path_prefix + ".idx"


def optimal_token_dtype(vocab_size: int) -> type:
    """The smallest dtype Megatron's preprocessing uses for ``vocab_size`` ids (uint16 or int32)."""
    # Megatron's cut-off: uint16 below 65500, leaving head-room under 2**16.
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    """Megatron's code for a numpy dtype; ValueError for a dtype the format cannot store."""
    try:
        return _CODE_OF_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise ValueError(
            f"dtype {np.dtype(dtype)} cannot be stored in an indexed dataset; use one of "
            f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}") from None


def encode_index(dtype, sequence_lengths, document_indices) -> bytes:
    """The bytes of a ``.idx`` file for sequences of ``sequence_lengths`` tokens of ``dtype``.

    Byte offsets are the exclusive prefix sums of the lengths times the item size, as Megatron writes
    them.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    documents = np.asarray(document_indices, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError("sequence lengths must be non-negative")
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError("a sequence longer than 2**31-1 tokens cannot be stored in an .idx file")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    header = (INDEX_MAGIC
              + struct.pack("<Q", INDEX_VERSION)
              + struct.pack("<B", dtype_code(dtype))
              + struct.pack("<Q", lengths.size)
              + struct.pack("<Q", documents.size))
    return (header
            + lengths.astype("<i4").tobytes(order="C")
            + pointers.astype("<i8").tobytes(order="C")
            + documents.astype("<i8").tobytes(order="C"))


def check_dataset_files(path_prefix: str) -> None:
    """Raise FileNotFoundError naming a missing ``PREFIX.idx`` / ``PREFIX.bin`` and the fix.

    A prefix given with its extension (``corpus_text_document.bin``, a frequent slip) is named as
    such, with the prefix to pass instead."""
    index_path, data_path = index_file_path(path_prefix), data_file_path(path_prefix)
    for path, role in ((index_path, "index"), (data_path, "data")):
        if os.path.isfile(path):
            continue
        stem, extension = os.path.splitext(path_prefix)
        if extension in (".bin", ".idx") and os.path.isfile(index_file_path(stem)):
            raise FileNotFoundError(
                f"--data-path {path_prefix} names a file, not a dataset prefix: pass {stem} "
                f"(without {extension}; the dataset is {stem}.bin + {stem}.idx)")
        raise FileNotFoundError(
            f"indexed dataset {role} file {path} does not exist; --data-path takes the prefix "
            f"without extension and needs both {index_path} and {data_path} (write them with "
            f"tools/preprocess_data.py)")


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin`` / ``PREFIX.idx`` pair.

    ``dataset[i]`` is sequence ``i`` as a numpy array of the file's dtype (a view into the map);
    :meth:`get` reads part of a sequence. ``sequence_lengths``, ``sequence_pointers`` and
    ``document_indices`` are the index arrays.
    """

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        self.index_path = index_file_path(path_prefix)
        self.data_path = data_file_path(path_prefix)
        self._fingerprint: Optional[str] = None
        check_dataset_files(path_prefix)
        self._read_index()
        self._check_data_file()

    # -- opening -------------------------------------------------------------------------------

    def _corrupt(self, problem: str) -> ValueError:
        return ValueError(f"{self.index_path}: {problem}; the file is corrupt or not a Megatron "
                          f"indexed-dataset index; rewrite it with tools/preprocess_data.py")

    def _read_index(self) -> None:
        index_size = os.path.getsize(self.index_path)
        if index_size < HEADER_SIZE:
            raise self._corrupt(f"only {index_size} bytes, shorter than the {HEADER_SIZE}-byte header")
        with open(self.index_path, "rb") as index_file:
            header = index_file.read(HEADER_SIZE)
        magic = header[:len(INDEX_MAGIC)]
        if magic != INDEX_MAGIC:
            raise self._corrupt(f"bad magic {magic!r}, expected {INDEX_MAGIC!r}")
        offset = len(INDEX_MAGIC)
        (version,) = struct.unpack_from("<Q", header, offset)
        if version != INDEX_VERSION:
            raise self._corrupt(f"unsupported version {version}, expected {INDEX_VERSION}")
        (code,) = struct.unpack_from("<B", header, offset + 8)
        if code not in DTYPE_CODES:
            raise self._corrupt(f"unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        sequence_count, document_count = struct.unpack_from("<QQ", header, offset + 9)
        expected_size = HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
        if index_size != expected_size:
            hint = ""
            if index_size == expected_size + sequence_count:
                hint = " (it looks like a multimodal index with sequence modes, which is not supported)"
            raise self._corrupt(
                f"{index_size} bytes, but its header ({sequence_count} sequences, {document_count} "
                f"document-index entries) implies {expected_size} bytes{hint}")
        if document_count < 1:
            raise self._corrupt("the document index is empty; it must start with 0")

        index_map = np.memmap(self.index_path, mode="r", dtype=np.uint8)
        self._index_map = index_map
        position = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(
            index_map, dtype="<i4", count=sequence_count, offset=position)
        position += sequence_count * 4
        self.sequence_pointers = np.frombuffer(
            index_map, dtype="<i8", count=sequence_count, offset=position)
        position += sequence_count * 8
        self.document_indices = np.frombuffer(
            index_map, dtype="<i8", count=document_count, offset=position)

        if sequence_count and self.sequence_lengths.min() < 0:
            raise self._corrupt("negative sequence length")
        documents = self.document_indices
        if documents[0] != 0 or documents[-1] != sequence_count or np.any(np.diff(documents) < 0):
            raise self._corrupt(
                f"document index must rise from 0 to the sequence count {sequence_count}, "
                f"got {documents[0]} .. {documents[-1]}")
        expected_pointers = np.zeros(sequence_count, dtype=np.int64)
        if sequence_count > 1:
            np.cumsum(self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize,
                      out=expected_pointers[1:])
        if not np.array_equal(expected_pointers, self.sequence_pointers):
            bad = int(np.argmax(expected_pointers != self.sequence_pointers))
            raise self._corrupt(
                f"byte offset of sequence {bad} is {int(self.sequence_pointers[bad])}, but the "
                f"lengths before it imply {int(expected_pointers[bad])}")
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))

    def _check_data_file(self) -> None:
        data_size = os.path.getsize(self.data_path)
        expected = self.num_tokens * self.dtype.itemsize
        if data_size != expected:
            state = "truncated" if data_size < expected else "longer than its index says"
            raise ValueError(
                f"{self.data_path} is {state}: {data_size} bytes, but {self.index_path} describes "
                f"{self.num_tokens} tokens of {self.dtype} = {expected} bytes; the .bin/.idx pair is "
                f"mismatched or incomplete; rewrite both with tools/preprocess_data.py")
        # np.memmap refuses empty files; an empty dataset has nothing to map.
        if data_size:
            self._data_map = np.memmap(self.data_path, mode="r", dtype=self.dtype)
        else:
            self._data_map = np.zeros(0, dtype=self.dtype)

    def __getstate__(self) -> dict:
        # Pickling (e.g. into spawned data-loader workers) sends the path, not the mapped data.
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"])

    # -- access --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def __getitem__(self, index: int) -> np.ndarray:
        if isinstance(index, slice):
            raise TypeError("IndexedDataset does not support slices; use get() per sequence")
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``index`` (to its end if length is None)."""
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(f"tokens {offset}..{offset + length} out of range for sequence {index} "
                             f"of length {sequence_length}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._data_map[start:start + length]

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the .bin as one read-only memory-mapped array."""
        return self._data_map

    def fingerprint(self) -> str:
        """Hash of the index contents and the data size: changes whenever the dataset is rewritten."""
        if self._fingerprint is None:
            from megatron.core.datasets.index_cache import file_fingerprint
            self._fingerprint = f"{file_fingerprint(self.index_path)}-{os.path.getsize(self.data_path)}"
        return self._fingerprint

    @property
    def num_documents(self) -> int:
        """Documents in the index (entries of the document index minus one)."""
        return int(self.document_indices.shape[0]) - 1


class IndexedDatasetBuilder:
    """Writes a ``.bin`` incrementally and the matching ``.idx`` on :meth:`finalize`.

    Usage: ``add_document(token_ids)`` per document (one sequence each, as preprocess_data writes
    text documents), or ``add_item`` per sequence followed by ``end_document``; then
    ``finalize(idx_path)``.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject unsupported dtypes before writing anything
        self.bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        self._sequence_lengths: list[int] = []
        self._document_indices: list[int] = [0]

    def add_item(self, token_ids: Iterable[int]) -> None:
        """Append one sequence."""
        array = np.asarray(token_ids)
        if array.size and array.dtype != self.dtype:
            info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
            if info is not None and (array.min() < info.min or array.max() > info.max):
                raise ValueError(f"token id outside the range of {self.dtype} "
                                 f"({array.min()}..{array.max()}); choose a wider dtype")
        self._data_file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document after the sequences added since the last one."""
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, token_ids: Iterable[int], lengths: Optional[list[int]] = None) -> None:
        """Append a document made of sequences of ``lengths`` tokens (one sequence if None)."""
        array = np.asarray(token_ids)
        if lengths is None:
            self.add_item(array)
        else:
            start = 0
            for length in lengths:
                self.add_item(array[start:start + length])
                start += length
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another dataset of the same dtype."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{other.index_path} has dtype {other.dtype}, this builder {self.dtype}")
        base = len(self._sequence_lengths)
        self._sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self._document_indices.extend(int(d) + base for d in other.document_indices[1:])
        with open(other.data_path, "rb") as data_file:
            while chunk := data_file.read(1 << 24):
                self._data_file.write(chunk)

    def abort(self) -> None:
        """Close and delete the partial ``.bin`` after a failed run."""
        self._data_file.close()
        if os.path.exists(self.bin_path):
            os.remove(self.bin_path)

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self._data_file.close()
        with open(idx_path, "wb") as index_file:
            index_file.write(encode_index(self.dtype, self._sequence_lengths,
                                          self._document_indices))
