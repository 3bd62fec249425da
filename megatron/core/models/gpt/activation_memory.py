"""Measure the activation memory a forward pass keeps for its backward pass.

:func:`count_stored_activations` records every tensor autograd saves while the block runs (through
``torch.autograd.graph.saved_tensors_hooks``) and adds up the bytes of the distinct storages behind
them, leaving out the model's parameters (they exist anyway). A storage saved several times (or
viewed by several saved tensors) counts once. This is what sequence parallelism and recomputation
change; it does not include temporaries freed before the backward pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class StoredActivations:
    """Distinct storages saved for backward (data pointer -> bytes) and their total."""

    storages: dict = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def count_stored_activations(model: torch.nn.Module):
    """Yield a :class:`StoredActivations` filled by the autograd graph built inside the block."""
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    stored = StoredActivations()

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameters and storage.nbytes():
            stored.storages[pointer] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield stored
