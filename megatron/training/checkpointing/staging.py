"""CPU copies of a rank's checkpoint pieces for a background save (``--async-save``), in buffers
kept from one save to the next.

The training thread copies the state before training changes it; that copy is most of what a
background save costs the training thread. :class:`StagingBuffers` keeps the copies' memory for
the run (every save of a run has the same pieces, unless the optimizer state appeared or the
layout changed: then it allocates anew) and copies the small tensors (see
:func:`.torch_dist.is_packed`) of one dtype with ONE ``torch.cat`` into one flat buffer, whose
views become the pieces' tensors: one kernel instead of one per tensor, and the packed object
that holds them is then a single storage for ``torch.save`` to write (and, for DCP's persistent
writer process, a single shared-memory segment to send, shared once for the run).

Building the pieces (their global keys, boxes and placements: :mod:`.global_keys`) costs the
training thread more than the copy, and gives the same pieces at every save of a run. So the
staged pieces are kept with the *signature* of the tensors they were copied from
(:func:`source_signature`: every state-dict entry's name and every tensor's memory address, shape,
strides, dtype and device): while a save's signature is the same, :meth:`StagingBuffers.restage`
copies the same sources into the same buffers and returns the kept pieces, and nothing is built.
Any difference (a parameter or optimizer state replaced, reshaped or added: the optimizer state
appearing after the first step, a resumed run in another layout) builds the pieces anew. The kept
sources alias the live tensors' memory (the signature compares addresses of tensors that the kept
sources hold alive, so equal addresses are the same memory; a run whose optimizer replaced its
state tensors at every step would build at every save, keeping the previous save's sources alive
until the next).

A buffer may be overwritten only once the save that read it has finished: the background save
waits for the previous one before it copies (:class:`.background.BackgroundSaver`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def source_signature(model_states: list, optimizer_states: Optional[list]) -> list:
    """What a snapshot's pieces are built from: per model chunk its state dict's names and
    tensors, per optimizer parameter (None: the optimizer state is not saved) its state's names
    and tensors; each tensor as (address, shape, strides, dtype, device). Equal signatures give
    equal pieces reading the same memory."""
    signature: list = [_state_signature(state) for state in model_states]
    if optimizer_states is not None:
        signature += [None if not state else _state_signature(state)
                      for state in optimizer_states]
    return signature


def _state_signature(state: dict) -> list:
    """(name, address, shape, strides, dtype, device) of each tensor of ``state`` (a list
    comprehension: this runs for every tensor at every save)."""
    return [(name, value.data_ptr(), value.shape, value.stride(), value.dtype, value.device)
            if isinstance(value, torch.Tensor) else (name, "object", type(value).__name__)
            for name, value in state.items()]


class StagingBuffers:
    """Reused CPU buffers for one rank's pieces (see the module docstring). ``generation``
    counts the times the pieces were built anew (what callers key their own caches by)."""

    def __init__(self):
        self.generation = 0
        self._signature: Optional[list] = None  # of the sources of the pieces kept
        self._pieces: list = []  # the pieces staged last, their tensors the buffers' views
        self._small_sources: list = []  # the tensors they were copied from, in staging order
        self._big_sources: list = []
        self._all_cpu = False  # whether the small sources are all in CPU memory
        self._layout: list = []  # (index, shape, dtype, device) of every piece staged last
        self._packed_here: set = set()
        self._flat: dict = {}    # (dtype, packed here) -> flat CPU buffer of such small pieces
        self._small: list = []   # positions of the small pieces, in order
        self._groups: list = []  # their (dtype, packed here)
        self._small_views: list = []  # their views into the flat buffers
        self._big: list = []     # positions of the others
        self._large: dict = {}   # piece index -> its own CPU buffer
        self._big_indices: dict = {}  # position of a large piece -> its index

    def restage(self, signature: list, packed_here: Optional[set] = None) -> Optional[list]:
        """The pieces staged last, their buffers refilled from the same sources, if ``signature``
        (:func:`source_signature` of this save) and ``packed_here`` are those they were staged
        with; else None (build the pieces and :meth:`stage` them)."""
        if self._signature is None or signature != self._signature or \
                set(packed_here or ()) != self._packed_here:
            return None
        self._copy(self._small_sources, self._big_sources, self._all_cpu)
        return self._pieces

    def stage(self, pieces, is_small: Callable[[object], bool],
              packed_here: Optional[set] = None, signature: Optional[list] = None) -> None:
        """Replace each piece's tensor by its copy in this rank's buffers (``is_small(piece)``:
        copied into the flat buffer of its dtype, else into a buffer of its own).
        ``packed_here``: the indices of the small pieces this rank packs (the cached save plan's,
        :class:`.background.PlanCache`): they get flat buffers of their own, in their order,
        which then are the packed object's buffers as they are (:func:`.dcp_io.pack_boxes`
        copies nothing). ``signature``: the sources' :func:`source_signature`, kept for
        :meth:`restage` (None: never restaged)."""
        packed_here = packed_here or set()
        layout = [(piece.index, piece.tensor.shape, piece.tensor.dtype, piece.tensor.device)
                  for piece in pieces]
        if layout != self._layout or packed_here != self._packed_here:
            self._allocate(pieces, is_small, packed_here)
            self._layout, self._packed_here = layout, set(packed_here)
        small_sources = [pieces[position].tensor for position in self._small]
        big_sources = [pieces[position].tensor.detach() for position in self._big]
        self._all_cpu = bool(small_sources) and \
            all(source.device.type == "cpu" for source in small_sources)
        self._copy(small_sources, big_sources, self._all_cpu)
        for position, view in zip(self._small, self._small_views):
            pieces[position].tensor = view
        for position in self._big:
            pieces[position].tensor = self._large[pieces[position].index]
        self.generation += 1
        self._signature, self._pieces = signature, pieces
        self._small_sources, self._big_sources = small_sources, big_sources

    def _copy(self, small_sources: list, big_sources: list, all_cpu: bool) -> None:
        """Copy the sources into this rank's buffers (in staging order; ``all_cpu``: the small
        ones are all in CPU memory)."""
        with torch.no_grad():
            if all_cpu:
                torch._foreach_copy_(self._small_views, small_sources)  # one call for all
            else:  # one transfer per dtype from the accelerator
                for (dtype, packed), flat in self._flat.items():
                    group = [source.reshape(-1) for source, key in zip(small_sources, self._groups)
                             if key == (dtype, packed)]
                    flat.copy_(torch.cat([source.to(group[0].device) for source in group]))
            for position, source in zip(self._big, big_sources):
                self._copy_large(self._big_indices[position], source)

    def _allocate(self, pieces: list, is_small: Callable[[object], bool],
                  packed_here: set) -> None:
        small = [position for position, piece in enumerate(pieces) if is_small(piece)]
        chosen = set(small)
        self._small = small
        self._big = [position for position in range(len(pieces)) if position not in chosen]
        self._groups = [(pieces[position].tensor.dtype, pieces[position].index in packed_here)
                        for position in small]
        sizes: dict = {}
        for position, group in zip(small, self._groups):
            sizes[group] = sizes.get(group, 0) + pieces[position].tensor.numel()
        self._flat = {group: torch.empty(total, dtype=group[0]) for group, total in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self._small_views = []
        for position, group in zip(small, self._groups):
            shape, numel = pieces[position].tensor.shape, pieces[position].tensor.numel()
            self._small_views.append(
                self._flat[group][offsets[group]:offsets[group] + numel].view(shape))
            offsets[group] += numel
        self._big_indices = {position: pieces[position].index for position in self._big}
        indices = set(self._big_indices.values())
        self._large = {index: buffer for index, buffer in self._large.items() if index in indices}

    def _copy_large(self, index, source: torch.Tensor) -> torch.Tensor:
        buffer = self._large.get(index)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._large[index] = torch.empty(source.shape, dtype=source.dtype)
        buffer.copy_(source)
        return buffer
