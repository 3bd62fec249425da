"""Blending several datasets with weights (``--data-path W1 P1 W2 P2 ...``).

Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``. The
blending index is built vectorised: the ``k``-th sample of dataset ``d`` is given the time
``(k + 1/2) / w_d`` and all samples are served in time order. So every prefix of the blend holds
each dataset in proportion to its weight, within a sample or so, and the index is a pure function of
the weights and the sample count.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from megatron.core.datasets.index_cache import load_or_build


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights as float64 summing to one; ValueError for negative or all-zero weights."""
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("blending needs at least one weight")
    if np.any(array < 0) or not np.all(np.isfinite(array)) or array.sum() <= 0:
        raise ValueError(f"blending weights must be non-negative with a positive sum, got "
                         f"{list(weights)}")
    return array / array.sum()


def build_blending_indices(weights: Sequence[float], num_samples: int) -> dict:
    """``dataset_index`` (int16) and ``dataset_sample_index`` (int64) of a blend of ``num_samples``."""
    normalized = normalize_weights(weights)
    times, owners, ranks = [], [], []
    for dataset, weight in enumerate(normalized):
        if weight == 0:
            continue
        # The N-th time is at most N - 1 + D/2 for D datasets, so dataset d appears at most
        # w_d * (N + D/2) + 1/2 times in the first N; one more keeps the bound strict.
        count = int(np.ceil(weight * (num_samples + len(normalized) / 2))) + 2
        sample_ranks = np.arange(count, dtype=np.int64)
        times.append((sample_ranks + 0.5) / weight)
        owners.append(np.full(count, dataset, dtype=np.int16))
        ranks.append(sample_ranks)
    # Stable sort: ties go to the dataset listed first, so the result is deterministic.
    order = np.argsort(np.concatenate(times), kind="stable")[:num_samples]
    return {"dataset_index": np.concatenate(owners)[order],
            "dataset_sample_index": np.concatenate(ranks)[order]}


def cached_blending_indices(weights: Sequence[float], num_samples: int, description: dict,
                            cache_dir: Optional[str],
                            log: Optional[Callable[[str], None]] = None) -> dict:
    """:func:`build_blending_indices`, cached under a key of the weights, count and description."""
    full_description = {"class": "BlendedDataset", "weights": [float(w) for w in weights],
                        "num_samples": int(num_samples), **description}
    return load_or_build(cache_dir, f"blend-{description.get('split', '')}", full_description,
                         ("dataset_index", "dataset_sample_index"),
                         lambda: build_blending_indices(weights, num_samples), log)


def samples_needed_per_dataset(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """How many samples the blend draws from each dataset."""
    return np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=num_datasets)


class BlendedDataset:
    """Serves ``datasets`` in the order of a blending index."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], blending_indices: dict):
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.dataset_index = blending_indices["dataset_index"]
        self.dataset_sample_index = blending_indices["dataset_sample_index"]
        needed = samples_needed_per_dataset(self.dataset_index, len(self.datasets))
        for dataset_number, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if count and (dataset is None or len(dataset) < count):
                raise ValueError(f"blended dataset {dataset_number} has "
                                 f"{0 if dataset is None else len(dataset)} samples, the blend "
                                 f"needs {count}")

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]
