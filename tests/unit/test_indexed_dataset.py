"""Megatron's .bin/.idx format: files written by hand with struct in Megatron's exact layout are read
back exactly, our writer produces identical bytes, and corrupt or mismatched files raise with the
file named."""

import os
import struct

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import (DTYPE_CODES, IndexedDataset,
                                                    IndexedDatasetBuilder, optimal_token_dtype)

SEQUENCES = [[1, 2, 3], [4], [5, 6], []]
DOCUMENT_INDICES = [0, 1, 4]  # document 0 = sequence 0; document 1 = sequences 1, 2, 3


def handwritten_pair(directory, name="data", dtype_code=4, sequences=SEQUENCES,
                     document_indices=DOCUMENT_INDICES):
    """Write PREFIX.bin/.idx field by field with struct, exactly as Megatron's _IndexWriter does."""
    dtype = np.dtype(DTYPE_CODES[dtype_code])
    prefix = os.path.join(directory, name)
    with open(prefix + ".bin", "wb") as data_file:
        for sequence in sequences:
            data_file.write(np.array(sequence, dtype=dtype).tobytes())
    lengths = [len(s) for s in sequences]
    pointers, position = [], 0
    for length in lengths:
        pointers.append(position)
        position += length * dtype.itemsize
    with open(prefix + ".idx", "wb") as index_file:
        index_file.write(b"MMIDIDX\x00\x00")
        index_file.write(struct.pack("<Q", 1))
        index_file.write(struct.pack("<B", dtype_code))
        index_file.write(struct.pack("<Q", len(sequences)))
        index_file.write(struct.pack("<Q", len(document_indices)))
        index_file.write(struct.pack(f"<{len(lengths)}i", *lengths))
        index_file.write(struct.pack(f"<{len(pointers)}q", *pointers))
        index_file.write(struct.pack(f"<{len(document_indices)}q", *document_indices))
    return prefix


def test_reads_handwritten_files_exactly(tmp_path):
    dataset = IndexedDataset(handwritten_pair(tmp_path))
    assert len(dataset) == 4 and dataset.num_documents == 2
    assert dataset.dtype == np.int32 and dataset.num_tokens == 6
    for index, sequence in enumerate(SEQUENCES):
        assert dataset[index].tolist() == sequence
    assert dataset.sequence_lengths.tolist() == [3, 1, 2, 0]
    assert dataset.sequence_pointers.tolist() == [0, 12, 16, 24]
    assert dataset.document_indices.tolist() == DOCUMENT_INDICES
    assert dataset.get(0, offset=1, length=2).tolist() == [2, 3]
    assert dataset.get(2, offset=1).tolist() == [6]
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=2)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_writer_produces_identical_bytes(tmp_path, code):
    expected = handwritten_pair(tmp_path, "expected", dtype_code=code)
    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype=DTYPE_CODES[code])
    builder.add_document(SEQUENCES[0])
    for sequence in SEQUENCES[1:]:
        builder.add_item(sequence)
    builder.end_document()
    builder.finalize(str(tmp_path / "ours.idx"))
    for extension in (".bin", ".idx"):
        assert (tmp_path / f"ours{extension}").read_bytes() == \
            open(expected + extension, "rb").read()
    dataset = IndexedDataset(str(tmp_path / "ours"))
    assert dataset.dtype == np.dtype(DTYPE_CODES[code])
    assert [dataset[i].tolist() for i in range(4)] == SEQUENCES


def test_add_index_concatenates(tmp_path):
    first = handwritten_pair(tmp_path, "first")
    builder = IndexedDatasetBuilder(str(tmp_path / "both.bin"), dtype=np.int32)
    builder.add_index(first)
    builder.add_index(first)
    builder.finalize(str(tmp_path / "both.idx"))
    both = IndexedDataset(str(tmp_path / "both"))
    assert [both[i].tolist() for i in range(8)] == SEQUENCES + SEQUENCES
    assert both.document_indices.tolist() == [0, 1, 4, 5, 8]


def test_writer_rejects_ids_outside_dtype(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="uint16"):
        builder.add_item([1, 70000])


def test_optimal_dtype_follows_megatron():
    assert optimal_token_dtype(50257) == np.uint16
    assert optimal_token_dtype(65499) == np.uint16
    assert optimal_token_dtype(65500) == np.int32
    assert optimal_token_dtype(128256) == np.int32


def corrupt(path, offset, data):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


@pytest.mark.parametrize("damage, message", [
    (lambda p: corrupt(p + ".idx", 0, b"XXIDIDX"), "bad magic"),
    (lambda p: corrupt(p + ".idx", 9, struct.pack("<Q", 2)), "unsupported version 2"),
    (lambda p: corrupt(p + ".idx", 17, struct.pack("<B", 9)), "unknown dtype code 9"),
    (lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), "implies"),
    (lambda p: os.truncate(p + ".idx", 10), "shorter than"),
    (lambda p: corrupt(p + ".idx", 18, struct.pack("<Q", 5)), "implies"),
    (lambda p: corrupt(p + ".idx", 34, struct.pack("<i", 2)), "byte offset of sequence 1"),
    (lambda p: corrupt(p + ".idx", 34 + 16 + 32, struct.pack("<q", 3)), "document index"),
])
def test_corrupt_index_raises_naming_file(tmp_path, damage, message):
    prefix = handwritten_pair(tmp_path)
    damage(prefix)
    with pytest.raises(ValueError, match=message) as error:
        IndexedDataset(prefix)
    assert prefix + ".idx" in str(error.value)


def test_truncated_or_mismatched_data_raises(tmp_path):
    prefix = handwritten_pair(tmp_path)
    os.truncate(prefix + ".bin", 20)
    with pytest.raises(ValueError, match="truncated") as error:
        IndexedDataset(prefix)
    assert prefix + ".bin" in str(error.value)
    with open(prefix + ".bin", "ab") as handle:
        handle.write(b"\0" * 12)
    with pytest.raises(ValueError, match="longer than its index"):
        IndexedDataset(prefix)
    # A .bin from another dataset with a different size: a mismatched pair.
    other = handwritten_pair(tmp_path, "other", sequences=[[1, 2]], document_indices=[0, 1])
    os.replace(other + ".bin", prefix + ".bin")
    with pytest.raises(ValueError, match="mismatched"):
        IndexedDataset(prefix)


def test_missing_files_raise_naming_file(tmp_path):
    prefix = handwritten_pair(tmp_path)
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match="data.bin"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="nothing.idx"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_pickles_by_path(tmp_path):
    import pickle

    dataset = IndexedDataset(handwritten_pair(tmp_path))
    payload = pickle.dumps(dataset)
    assert len(payload) < 200 + len(str(tmp_path))  # the path, not the data
    copy = pickle.loads(payload)
    assert [copy[i].tolist() for i in range(4)] == SEQUENCES
