"""Train/valid/test GPT datasets from ``--data-path``, ``--split`` and sample counts.

Entry point: :func:`build_gpt_datasets`. Documents of each indexed dataset are divided into three
contiguous ranges by ``--split`` (Megatron's rounding); each range becomes a :class:`GPTDataset`;
several weighted prefixes become a :class:`BlendedDataset` per split. Indices are cached in
``--data-cache-path``, else in a ``cache/`` folder next to each dataset.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from megatron.core.datasets.blended_dataset import (BlendedDataset, cached_blending_indices,
                                                    normalize_weights, samples_needed_per_dataset)
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, check_dataset_files

SPLIT_NAMES = ("train", "valid", "test")
# Tokens read from the start of each .bin to check that its ids fit the tokenizer.
_VOCAB_CHECK_TOKENS = 1 << 20


def parse_data_path(data_path) -> tuple[list[str], Optional[list[float]]]:
    """``--data-path`` as (prefixes, weights); weights is None for unweighted prefixes.

    Accepts ``[P]``, ``[W1, P1, W2, P2, ...]`` and the same as one whitespace-separated string.
    """
    if data_path is None:
        raise ValueError("no --data-path given: pass a dataset prefix (PREFIX.bin/PREFIX.idx), "
                         "weight-prefix pairs to blend, or --mock-data")
    items = data_path.split() if isinstance(data_path, str) else [
        word for item in data_path for word in str(item).split()]
    if not items:
        raise ValueError("--data-path is empty: pass a dataset prefix or weight-prefix pairs")

    def is_number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    if is_number(items[0]):
        if len(items) % 2 or not all(is_number(w) for w in items[0::2]) or any(
                is_number(p) for p in items[1::2]):
            raise ValueError(f"--data-path {' '.join(items)}: weighted paths must alternate "
                             f"weight and prefix, e.g. '--data-path 0.3 corpusA 0.7 corpusB'")
        weights = [float(w) for w in items[0::2]]
        normalize_weights(weights)  # validates
        return list(items[1::2]), weights
    if any(is_number(item) for item in items):
        raise ValueError(f"--data-path {' '.join(items)}: give either prefixes only or "
                         f"weight-prefix pairs throughout")
    return items, None


def parse_split(split: str) -> tuple[float, float, float]:
    """``"949,50,1"`` (or ``"969, 30, 1"``, ``"98/2/0"``, ``"100"``) as three fractions summing to 1."""
    numbers = [float(x) for x in re.findall(r"[0-9]*\.?[0-9]+", str(split))]
    if not 1 <= len(numbers) <= 3 or sum(numbers) <= 0:
        raise ValueError(f"--split {split!r} must be one to three non-negative numbers with a "
                         f"positive sum, e.g. 949,50,1")
    numbers += [0.0] * (3 - len(numbers))
    total = sum(numbers)
    return (numbers[0] / total, numbers[1] / total, numbers[2] / total)


def split_document_ranges(fractions: Sequence[float], num_documents: int) -> list[tuple[int, int]]:
    """Contiguous [begin, end) document ranges per split, rounded as Megatron rounds them."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds[1:] = [bound - excess for bound in bounds[1:]]
    return [(max(0, bounds[i]), max(0, bounds[i + 1])) for i in range(len(fractions))]


def default_cache_dir(path_prefix: str) -> str:
    """Where indices are cached without --data-cache-path: a cache/ folder beside the dataset."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache")


def check_vocabulary(dataset: IndexedDataset, vocab_size: int) -> None:
    """ValueError when the first tokens of ``dataset`` hold ids outside the tokenizer's vocabulary."""
    if dataset.num_tokens == 0:
        return
    head = dataset.tokens[:_VOCAB_CHECK_TOKENS]
    largest = int(head.max())
    if largest >= vocab_size or int(head.min()) < 0:
        raise ValueError(
            f"{dataset.data_path} holds token id {largest}, but the tokenizer has only {vocab_size} "
            f"ids; the data was preprocessed with another tokenizer. Pass the tokenizer files used "
            f"by tools/preprocess_data.py (--tokenizer-type, --vocab-file/--merge-file or "
            f"--tokenizer-model)")


def check_data_path_files(data_path) -> None:
    """Check that every prefix of ``--data-path`` has its ``.bin`` and ``.idx`` (FileNotFoundError
    naming the first missing one and the fix). Cheap and process-group free: the entry point calls
    it before any rendezvous, so a mistyped path stops every rank at once with one line."""
    prefixes, _ = parse_data_path(data_path)
    for prefix in prefixes:
        check_dataset_files(prefix)


def build_gpt_datasets(data_config, seq_length: int, seed: int,
                       num_samples: Sequence[Optional[int]], tokenizer=None, *,
                       log: Optional[Callable[[str], None]] = None):
    """(train, valid, test) GPT datasets; a split with weight 0 (or no documents) is None.

    ``data_config`` is a :class:`megatron.core.config.DataConfig` (``data_path``, ``split``,
    ``data_cache_path``). ``num_samples`` gives the samples wanted per split; None or 0 means one
    epoch. ``tokenizer`` (optional) is used to check that the data's ids fit its vocabulary. Each
    returned dataset has ``__len__`` and ``__getitem__`` returning ``{"text": int64[seq_length + 1]}``.
    """
    prefixes, weights = parse_data_path(data_config.data_path)
    fractions = parse_split(data_config.split)
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must have three entries (train, valid, test), got "
                         f"{num_samples}")
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    if tokenizer is not None:
        for dataset in datasets:
            check_vocabulary(dataset, tokenizer.vocab_size)
    cache_path = getattr(data_config, "data_cache_path", None)
    cache_dirs = [cache_path or default_cache_dir(prefix) for prefix in prefixes]
    ranges = [split_document_ranges(fractions, len(dataset)) for dataset in datasets]

    results = []
    for split_number, split_name in enumerate(SPLIT_NAMES):
        if fractions[split_number] == 0:
            results.append(None)
            continue
        components = [(dataset, np.arange(*dataset_ranges[split_number]), cache_dir)
                      for dataset, dataset_ranges, cache_dir in zip(datasets, ranges, cache_dirs)]
        wanted = num_samples[split_number]
        if len(datasets) == 1:
            results.append(_single_split(components[0], split_name, seq_length, seed, wanted, log))
        else:
            results.append(_blended_split(components, weights, split_name, seq_length, seed, wanted,
                                          cache_path or cache_dirs[0], log))
    return tuple(results)


def _split_tokens(component) -> int:
    dataset, document_ids, _ = component
    return int(dataset.sequence_lengths[document_ids].sum(dtype=np.int64))


def _warn(message: str, log) -> None:
    (log or (lambda text: print(text, file=sys.stderr)))(f"WARNING: {message}")


def _single_split(component, split_name, seq_length, seed, wanted, log):
    dataset, document_ids, cache_dir = component
    if document_ids.size == 0:
        _warn(f"the {split_name} split of {dataset.path_prefix} has no documents (--split gives it "
              f"less than one of {len(dataset)}); no {split_name} dataset", log)
        return None
    return GPTDataset(dataset, document_ids, seq_length, wanted, seed, split_name, cache_dir, log)


def _blended_split(components, weights, split_name, seq_length, seed, wanted, blend_cache_dir, log):
    tokens = [_split_tokens(component) for component in components]
    if weights is None:
        # Unweighted prefixes are concatenated: each contributes in proportion to its tokens.
        weights = [float(count) for count in tokens]
    usable = [i for i, count in enumerate(tokens) if count > seq_length and weights[i] > 0]
    for i, component in enumerate(components):
        if i not in usable and weights[i] > 0:
            _warn(f"{component[0].path_prefix} has {tokens[i]} tokens in the {split_name} split, "
                  f"too few for one sample; it is left out of the {split_name} blend", log)
    if not usable:
        return None
    used_weights = [weights[i] for i in usable]
    if not wanted:
        wanted = sum((tokens[i] - 1) // seq_length for i in usable)
    indices = cached_blending_indices(used_weights, wanted, {"split": split_name},
                                      blend_cache_dir, log)
    needed = samples_needed_per_dataset(indices["dataset_index"], len(usable))
    members = []
    for position, i in enumerate(usable):
        dataset, document_ids, cache_dir = components[i]
        members.append(GPTDataset(dataset, document_ids, seq_length, int(needed[position]), seed,
                                  split_name, cache_dir, log) if needed[position] else None)
    return BlendedDataset(members, used_weights, indices)
