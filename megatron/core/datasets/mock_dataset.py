"""Deterministic synthetic GPT data for ``--mock-data``: training runs before any data exists.

Sample ``i`` of a split is a pure function of ``(seed, split, i)``: an arithmetic progression modulo
the vocabulary, ``x_t = (start + step * t) mod vocab_size``, with a random start and a small random
step (1..max_step). The data is *learnable*: after two tokens the rest of a sequence is determined, so
a model quickly lowers its loss from ``ln(vocab_size)`` toward zero, which makes "training works" visible
in a few iterations. Samples follow the GPT dataset contract: ``{"text": int64[seq_length + 1]}``.
"""

from __future__ import annotations

import numpy as np

# Distinct random streams for the three splits, so validation data is not the training data.
_SPLIT_STREAMS = {"train": 0, "valid": 1, "test": 2}


class MockGPTDataset:
    """``num_samples`` synthetic sequences of ``seq_length + 1`` tokens in ``[0, vocab_size)``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int,
                 split: str = "train", max_step: int = 8):
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 tokens, got {vocab_size}; "
                             f"raise --vocab-size")
        if split not in _SPLIT_STREAMS:
            raise ValueError(f"unknown split {split!r}; use one of {sorted(_SPLIT_STREAMS)}")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.split = split
        self.max_step = max(1, min(int(max_step), self.vocab_size - 1))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} outside the {self.split} mock dataset of "
                             f"{self.num_samples} samples")
        rng = np.random.Generator(np.random.PCG64([self.seed, _SPLIT_STREAMS[self.split], index]))
        start = int(rng.integers(0, self.vocab_size))
        step = int(rng.integers(1, self.max_step + 1))
        positions = np.arange(self.seq_length + 1, dtype=np.int64)
        return {"text": (start + step * positions) % self.vocab_size}


def build_mock_datasets(num_samples: tuple[int, int, int], seq_length: int, vocab_size: int,
                        seed: int) -> tuple:
    """Train, validation and test mock datasets (``None`` for a split of 0 samples)."""
    return tuple(MockGPTDataset(count, seq_length, vocab_size, seed, split) if count > 0 else None
                 for count, split in zip(num_samples, ("train", "valid", "test")))
