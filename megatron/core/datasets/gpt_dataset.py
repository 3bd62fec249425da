"""GPT dataset: documents concatenated and cut into windows of ``seq_length + 1`` tokens.

Three index arrays, built with vectorised numpy and cached next to the data (see
:mod:`megatron.core.datasets.index_cache`), map sample ``i`` to its tokens:

- document index: the order of the documents, a fresh permutation per epoch, epochs concatenated;
- sample index: for each sample, the (position in the document index, token offset) where its
  window starts. Sample ``s`` starts at token ``s * seq_length`` of the concatenated stream and
  spans ``seq_length + 1`` tokens, so consecutive windows share one token and every token of an
  epoch is a training target exactly once;
- shuffle index: the order in which samples are served, a permutation within each epoch, so all of
  one epoch is seen before the next begins.

Epoch ``e`` owns the windows that start in its tokens, ``[e T, (e + 1) T)`` of the stream (``T``
tokens per epoch); each epoch's permutation covers all of them, drawn from a random state of its own
(seed, epoch), and the document index holds enough further epochs for the last window to end. So
sample ``i`` is a pure function of (data, documents, seq_length, seed), whatever ``num_samples``:
a run with a longer ``--train-iters``, or one resumed with a longer one, serves the same samples in
the same order as far as the shorter one went (Megatron's order is stable this way only while the
epoch count does not change; until 2026-12-02 ours depended on ``num_samples`` even within one
epoch, so resuming with another ``--train-iters`` served a different permutation). The training
loop resumes from the consumed-samples count by index. A sample is ``{"text": int64[seq_length + 1]}``;
tokens are ``text[:-1]`` and labels ``text[1:]``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Optional

import numpy as np

from megatron.core.datasets.index_cache import load_or_build
from megatron.core.datasets.indexed_dataset import IndexedDataset

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


# Bump when the meaning of the cached index arrays changes (old cache entries are then rebuilt).
INDEX_VERSION = 2


def windows_starting_before(tokens: int, seq_length: int) -> int:
    """Windows whose start ``s * seq_length`` lies in the first ``tokens`` tokens of the stream."""
    return -(-tokens // seq_length)


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs in which at least ``num_samples`` windows start."""
    return max(1, (max(num_samples, 1) - 1) * seq_length // tokens_per_epoch + 1)


def document_epochs_needed(num_epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Epochs of documents the stream needs so that the last window starting in ``num_epochs``
    epochs ends inside it (it may reach ``seq_length`` tokens into the following ones)."""
    return num_epochs + -(-(seq_length + 1) // tokens_per_epoch)


def build_document_index(document_ids: np.ndarray, num_epochs: int,
                         random_state: np.random.RandomState) -> np.ndarray:
    """Each epoch's documents in a fresh random order, epochs one after another."""
    dtype = np.int32 if document_ids.size == 0 or document_ids.max() < 2 ** 31 else np.int64
    epochs = [random_state.permutation(document_ids).astype(dtype) for _ in range(num_epochs)]
    return np.concatenate(epochs) if epochs else np.zeros(0, dtype=dtype)


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """``[num_samples, 2]`` int64: (document-index position, token offset) where each window starts.

    Window ``s`` starts at token ``s * seq_length`` of the stream of documents in document-index
    order; a binary search over the running token count finds its document.
    """
    lengths_in_order = sequence_lengths[document_index].astype(np.int64)
    document_ends = np.cumsum(lengths_in_order)
    window_starts = np.arange(num_samples, dtype=np.int64) * seq_length
    total_tokens = int(document_ends[-1]) if document_ends.size else 0
    assert num_samples == 0 or window_starts[-1] + seq_length + 1 <= total_tokens, \
        "document index too short for the requested samples"
    # side="right": the first document whose end lies beyond the start, which skips empty documents.
    positions = np.searchsorted(document_ends, window_starts, side="right")
    offsets = window_starts - (document_ends[positions] - lengths_in_order[positions])
    return np.stack([positions.astype(np.int64), offsets], axis=1)


def epoch_random_state(seed: int, epoch: int) -> np.random.RandomState:
    """The random state of one epoch's sample order: a function of (seed, epoch) only."""
    return np.random.RandomState([seed % 2 ** 32, epoch])


def build_shuffle_index(num_samples: int, seq_length: int, tokens_per_epoch: int,
                        seed: int) -> np.ndarray:
    """Order of the first ``num_samples`` samples: each epoch's windows (those starting in its
    tokens) permuted as a whole with the epoch's own random state, epoch after epoch."""
    dtype = np.int32 if num_samples < 2 ** 31 else np.int64
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    pieces = []
    for epoch in range(num_epochs):
        begin = windows_starting_before(epoch * tokens_per_epoch, seq_length)
        end = windows_starting_before((epoch + 1) * tokens_per_epoch, seq_length)
        pieces.append(begin + epoch_random_state(seed, epoch).permutation(end - begin))
    return np.concatenate(pieces)[:num_samples].astype(dtype)


class GPTDataset:
    """Fixed-length GPT samples over a set of documents of an :class:`IndexedDataset`.

    ``document_ids`` are the sequences of the indexed dataset in this split. ``num_samples`` None (or
    0) means one epoch. ``cache_dir`` None disables the cache.
    """

    def __init__(self, indexed_dataset: IndexedDataset, document_ids: np.ndarray, seq_length: int,
                 num_samples: Optional[int], seed: int, split_name: str = "train",
                 cache_dir: Optional[str] = None, log: Optional[Callable[[str], None]] = None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.indexed_dataset = indexed_dataset
        self.seq_length = int(seq_length)
        self.split_name = split_name
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        self.sequence_lengths = indexed_dataset.sequence_lengths
        self.tokens_per_epoch = int(self.sequence_lengths[self.document_ids].sum(dtype=np.int64))
        one_epoch = windows_starting_before(self.tokens_per_epoch, self.seq_length)
        fits_one_window = self.tokens_per_epoch >= self.seq_length + 1
        if self.tokens_per_epoch == 0 or (not num_samples and not fits_one_window):
            raise ValueError(
                f"the {split_name} split of {indexed_dataset.path_prefix} has {self.tokens_per_epoch} "
                f"tokens in {self.document_ids.size} documents, fewer than one sample of "
                f"seq-length + 1 = {self.seq_length + 1}; use more data, a shorter --seq-length or "
                f"a larger share in --split")
        self.num_samples = int(num_samples) if num_samples else one_epoch
        self.seed = int(seed)
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, self.seq_length, self.num_samples)

        description = {
            "class": "GPTDataset",
            "dataset": os.path.basename(indexed_dataset.path_prefix),
            "dataset_fingerprint": indexed_dataset.fingerprint(),
            "documents": _ids_description(self.document_ids),
            "seq_length": self.seq_length,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "split": split_name,
            "index_version": INDEX_VERSION,
        }
        stem = f"{os.path.basename(indexed_dataset.path_prefix)}-{split_name}"
        arrays = load_or_build(cache_dir, stem, description, _INDEX_NAMES, self._build_indices, log)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        assert self.shuffle_index.shape[0] == self.num_samples, "cache entry does not match"

    def _build_indices(self) -> dict:
        random_state = np.random.RandomState(self.seed % 2 ** 32)  # epoch e: the e-th draw
        document_index = build_document_index(
            self.document_ids,
            document_epochs_needed(self.num_epochs, self.tokens_per_epoch, self.seq_length),
            random_state)
        sample_index = build_sample_index(
            self.sequence_lengths, document_index, self.seq_length,
            windows_starting_before(self.num_epochs * self.tokens_per_epoch, self.seq_length))
        shuffle_index = build_shuffle_index(self.num_samples, self.seq_length,
                                            self.tokens_per_epoch, self.seed)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return {"text": self.window(int(self.shuffle_index[index]))}

    def window(self, sample: int) -> np.ndarray:
        """Tokens of window ``sample`` in stream order (before shuffling), int64[seq_length + 1]."""
        position, offset = (int(value) for value in self.sample_index[sample])
        needed = self.seq_length + 1
        parts = []
        while needed > 0:
            sequence = int(self.document_index[position])
            take = min(int(self.sequence_lengths[sequence]) - offset, needed)
            if take > 0:
                parts.append(self.indexed_dataset.get(sequence, offset, take))
                needed -= take
            position += 1
            offset = 0
        return np.concatenate(parts).astype(np.int64)


def _ids_description(document_ids: np.ndarray):
    """Short, exact description of a document-id set for the cache key."""
    if document_ids.size and np.array_equal(
            document_ids, np.arange(document_ids[0], document_ids[0] + document_ids.size)):
        return {"range": [int(document_ids[0]), int(document_ids[0] + document_ids.size)]}
    digest = hashlib.sha1(np.ascontiguousarray(document_ids, dtype="<i8").tobytes()).hexdigest()
    return {"count": int(document_ids.size), "sha1": digest}
