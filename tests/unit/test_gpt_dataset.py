"""GPT dataset, blending and the builder: windows cover the token stream exactly once per epoch,
blending follows the weights, indices are deterministic per seed, cached and invalidated when any
input changes."""

import os

import numpy as np
import pytest

from megatron.core.config import DataConfig
from megatron.core.datasets import gpt_dataset as gpt_dataset_module
from megatron.core.datasets.blended_dataset import build_blending_indices
from megatron.core.datasets.builder import (build_gpt_datasets, parse_data_path, parse_split,
                                            split_document_ranges)
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training.tokenizer import NullTokenizer


def write_dataset(prefix, num_documents=60, seed=0, max_length=40, vocab=500, first_token=None):
    """Random documents (some empty); each document's tokens start at ``first_token`` if given."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    documents = []
    for _ in range(num_documents):
        tokens = rng.integers(0, vocab, rng.integers(0, max_length))
        if first_token is not None:
            tokens[:] = first_token
        documents.append(tokens)
        builder.add_document(tokens)
    builder.finalize(str(prefix) + ".idx")
    return IndexedDataset(str(prefix)), documents


def stream_of(dataset: GPTDataset) -> np.ndarray:
    """The token stream rebuilt independently from the document index."""
    return np.concatenate([dataset.indexed_dataset[int(d)] for d in dataset.document_index]
                          ).astype(np.int64)


@pytest.mark.parametrize("seq_length", [1, 7, 16, 64])
def test_windows_cover_the_stream_once_per_epoch(tmp_path, seq_length):
    indexed, _ = write_dataset(tmp_path / "d")
    documents = np.arange(5, 55)
    dataset = GPTDataset(indexed, documents, seq_length, None, seed=3)
    epoch_tokens = int(indexed.sequence_lengths[documents].sum())
    # One epoch: every window that starts in its tokens (the last may end in the next epoch).
    assert len(dataset) == -(-epoch_tokens // seq_length)
    # The first epoch of the document index is a permutation of the split's documents.
    assert sorted(dataset.document_index[:documents.size].tolist()) == documents.tolist()
    stream = stream_of(dataset)
    covered = np.zeros(epoch_tokens, dtype=np.int64)
    served = []
    for index in range(len(dataset)):
        text = dataset[index]["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        sample = int(dataset.shuffle_index[index])
        served.append(sample)
        start = sample * seq_length
        np.testing.assert_array_equal(text, stream[start:start + seq_length + 1])
        covered[start + 1:start + seq_length + 1] += 1  # the targets of this window (in the epoch)
    assert sorted(served) == list(range(len(dataset)))
    # Every token of the epoch after the first is a target exactly once.
    assert np.all(covered[1:] == 1)


def test_several_epochs_are_served_in_order(tmp_path):
    indexed, _ = write_dataset(tmp_path / "d", num_documents=20)
    documents = np.arange(20)
    epoch_tokens = int(indexed.sequence_lengths.sum())
    seq_length = 8
    dataset = GPTDataset(indexed, documents, seq_length, 4 * epoch_tokens // seq_length, seed=1)
    assert dataset.num_epochs >= 4
    for epoch in range(dataset.num_epochs):
        order = dataset.document_index[epoch * 20:(epoch + 1) * 20]
        assert sorted(order.tolist()) == documents.tolist()
    epochs_served = (np.asarray(dataset.shuffle_index) * seq_length) // epoch_tokens
    assert np.all(np.diff(epochs_served) >= 0)
    stream = stream_of(dataset)
    for index in range(0, len(dataset), 7):
        start = int(dataset.shuffle_index[index]) * seq_length
        np.testing.assert_array_equal(dataset[index]["text"], stream[start:start + seq_length + 1])


@pytest.mark.parametrize("shorter,longer", [(20, 60), (50, 120), (130, 700), (7, 3000)])
def test_a_longer_run_serves_the_shorter_run_s_samples_first(tmp_path, shorter, longer):
    """--train-iters 20 and 30 (or a run resumed with a longer --train-iters) see the same samples
    in the same order as far as the shorter goes, within one epoch and across epoch counts (the
    order used to depend on the requested count: a resume with a longer --train-iters continued in
    another permutation, repeating some samples of the epoch and skipping others)."""
    indexed, _ = write_dataset(tmp_path / "d")
    documents = np.arange(60)
    short = GPTDataset(indexed, documents, 16, shorter, seed=5)
    long = GPTDataset(indexed, documents, 16, longer, seed=5)
    for index in range(shorter):
        np.testing.assert_array_equal(short[index]["text"], long[index]["text"])


def test_deterministic_per_seed(tmp_path):
    indexed, _ = write_dataset(tmp_path / "d")
    documents = np.arange(60)
    first = GPTDataset(indexed, documents, 16, 200, seed=7)
    again = GPTDataset(indexed, documents, 16, 200, seed=7)
    other = GPTDataset(indexed, documents, 16, 200, seed=8)
    samples = [first[i]["text"] for i in range(len(first))]
    assert all(np.array_equal(s, again[i]["text"]) for i, s in enumerate(samples))
    assert not all(np.array_equal(s, other[i]["text"]) for i, s in enumerate(samples))
    with pytest.raises(IndexError):
        first[len(first)]


def test_cache_reuse_and_invalidation(tmp_path, monkeypatch):
    indexed, _ = write_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    documents = np.arange(60)
    built = GPTDataset(indexed, documents, 16, 100, seed=1, cache_dir=str(cache))
    assert len([f for f in os.listdir(cache) if f.endswith(".npy")]) == 3
    calls = []
    original = gpt_dataset_module.build_sample_index
    monkeypatch.setattr(gpt_dataset_module, "build_sample_index",
                        lambda *args: calls.append(args) or original(*args))
    loaded = GPTDataset(indexed, documents, 16, 100, seed=1, cache_dir=str(cache))
    assert calls == []  # reused, not rebuilt
    assert isinstance(loaded.sample_index, np.memmap)
    for index in range(len(built)):
        np.testing.assert_array_equal(built[index]["text"], loaded[index]["text"])
    # Every input that shapes the indices gives a new entry.
    for variant in [dict(seq_length=8), dict(num_samples=50), dict(seed=2),
                    dict(document_ids=np.arange(50))]:
        arguments = dict(document_ids=documents, seq_length=16, num_samples=100, seed=1)
        arguments.update(variant)
        GPTDataset(indexed, cache_dir=str(cache), **arguments)
    assert len(calls) == 4
    # Rewriting the data under the same name invalidates the cache.
    rewritten, _ = write_dataset(tmp_path / "d", seed=99)
    GPTDataset(rewritten, documents, 16, 100, seed=1, cache_dir=str(cache))
    assert len(calls) == 5


def test_unreadable_cache_is_rebuilt(tmp_path, capsys):
    indexed, _ = write_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    built = GPTDataset(indexed, np.arange(60), 16, 100, seed=1, cache_dir=str(cache))
    (sample_file,) = [f for f in os.listdir(cache) if f.endswith("sample_index.npy")]
    (cache / sample_file).write_bytes(b"garbage")
    rebuilt = GPTDataset(indexed, np.arange(60), 16, 100, seed=1, cache_dir=str(cache))
    assert "rebuilding" in capsys.readouterr().err
    np.testing.assert_array_equal(rebuilt[3]["text"], built[3]["text"])
    reloaded = GPTDataset(indexed, np.arange(60), 16, 100, seed=1, cache_dir=str(cache))
    assert isinstance(reloaded.sample_index, np.memmap)


def test_too_small_split_raises(tmp_path):
    indexed, _ = write_dataset(tmp_path / "d", num_documents=3, max_length=4)
    with pytest.raises(ValueError, match="fewer than one sample"):
        GPTDataset(indexed, np.arange(3), 64, None, seed=1)


def test_parse_split_and_ranges():
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert parse_split("969, 30, 1") == pytest.approx((0.969, 0.03, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    with pytest.raises(ValueError, match="--split"):
        parse_split("0,0,0")
    assert split_document_ranges(parse_split("949,50,1"), 1000) == [(0, 949), (949, 999),
                                                                     (999, 1000)]
    # Megatron adds the rounding shortfall to every bound after the first.
    assert split_document_ranges(parse_split("1,1,1"), 10) == [(0, 4), (4, 7), (7, 10)]


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    for bad in (["0.3", "a", "b"], ["a", "0.5"], None, [], ["0.5", "a", "-1", "b"]):
        with pytest.raises(ValueError):
            parse_data_path(bad)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 2], [0.05, 0.9, 0.05]])
def test_blending_follows_weights(weights):
    num_samples = 2000
    indices = build_blending_indices(weights, num_samples)
    dataset_index = indices["dataset_index"]
    normalized = np.asarray(weights, dtype=float) / sum(weights)
    counts = np.zeros(len(weights))
    for position, dataset in enumerate(dataset_index):
        counts[dataset] += 1
        # Every prefix holds each dataset in proportion to its weight, within about a sample.
        assert np.all(np.abs(counts - normalized * (position + 1)) <= 1.5)
    for dataset in range(len(weights)):
        ranks = indices["dataset_sample_index"][dataset_index == dataset]
        assert ranks.tolist() == list(range(ranks.size))  # each dataset's samples in order


def test_build_gpt_datasets_single(tmp_path):
    write_dataset(tmp_path / "d", num_documents=100)
    config = DataConfig(data_path=[str(tmp_path / "d")], split="80,20,0")
    train, valid, test = build_gpt_datasets(config, 16, 1234, (300, 10, 5), NullTokenizer(500))
    assert len(train) == 300 and len(valid) == 10 and test is None
    assert train[299]["text"].shape == (17,)
    assert os.path.isdir(tmp_path / "cache")  # default cache next to the data
    # Train documents and valid documents are disjoint ranges.
    assert set(train.document_ids.tolist()).isdisjoint(valid.document_ids.tolist())
    again, _, _ = build_gpt_datasets(config, 16, 1234, (300, 10, 5))
    for index in (0, 150, 299):  # resuming by index gives the same sample
        np.testing.assert_array_equal(again[index]["text"], train[index]["text"])
    with pytest.raises(ValueError, match="another tokenizer"):
        build_gpt_datasets(config, 16, 1234, (300, 10, 5), NullTokenizer(10))


def test_build_gpt_datasets_blended(tmp_path):
    # Each dataset's tokens are one constant, so a sample tells which dataset it came from.
    write_dataset(tmp_path / "a", num_documents=80, first_token=1)
    write_dataset(tmp_path / "b", num_documents=80, seed=1, first_token=2)
    config = DataConfig(data_path=["0.25", str(tmp_path / "a"), "0.75", str(tmp_path / "b")],
                        split="90,10,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_gpt_datasets(config, 8, 5, (400, 40, 0))
    assert len(train) == 400 and len(valid) == 40 and test is None
    sources = [int(train[i]["text"][0]) for i in range(len(train))]
    assert sources.count(1) == 100 and sources.count(2) == 300
    again, _, _ = build_gpt_datasets(config, 8, 5, (400, 40, 0))
    assert [int(again[i]["text"][0]) for i in range(len(again))] == sources


def test_build_gpt_datasets_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.idx"):
        build_gpt_datasets(DataConfig(data_path=[str(tmp_path / "missing")]), 8, 1, (1, 1, 1))
    with pytest.raises(ValueError, match="--data-path"):
        build_gpt_datasets(DataConfig(), 8, 1, (1, 1, 1))
