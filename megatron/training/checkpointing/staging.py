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

A buffer may be overwritten only once the save that read it has finished: the background save
waits for the previous one before it copies (:class:`.background.BackgroundSaver`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class StagingBuffers:
    """Reused CPU buffers for one rank's pieces (see the module docstring)."""

    def __init__(self):
        self._layout: list = []  # (index, shape, dtype, device) of every piece staged last
        self._packed_here: set = set()
        self._flat: dict = {}    # (dtype, packed here) -> flat CPU buffer of such small pieces
        self._small: list = []   # positions of the small pieces, in order
        self._groups: list = []  # their (dtype, packed here)
        self._small_views: list = []  # their views into the flat buffers
        self._big: list = []     # positions of the others
        self._large: dict = {}   # piece index -> its own CPU buffer

    def stage(self, pieces, is_small: Callable[[object], bool],
              packed_here: Optional[set] = None) -> None:
        """Replace each piece's tensor by its copy in this rank's buffers (``is_small(piece)``:
        copied into the flat buffer of its dtype, else into a buffer of its own).
        ``packed_here``: the indices of the small pieces this rank packs (the cached save plan's,
        :class:`.background.PlanCache`): they get flat buffers of their own, in their order,
        which then are the packed object's buffers as they are (:func:`.dcp_io.pack_boxes`
        copies nothing)."""
        packed_here = packed_here or set()
        layout = [(piece.index, piece.tensor.shape, piece.tensor.dtype, piece.tensor.device)
                  for piece in pieces]
        if layout != self._layout or packed_here != self._packed_here:
            self._allocate(pieces, is_small, packed_here)
            self._layout, self._packed_here = layout, set(packed_here)
        sources = [pieces[position].tensor for position in self._small]
        with torch.no_grad():
            if sources and all(source.device.type == "cpu" for source in sources):
                torch._foreach_copy_(self._small_views, sources)  # one call, no per-piece Python
            else:  # one transfer per dtype from the accelerator
                for (dtype, packed), flat in self._flat.items():
                    group = [source.reshape(-1) for source, key in zip(sources, self._groups)
                             if key == (dtype, packed)]
                    flat.copy_(torch.cat([source.to(group[0].device) for source in group]))
        for position, view in zip(self._small, self._small_views):
            pieces[position].tensor = view
        for position in self._big:
            piece = pieces[position]
            piece.tensor = self._copy_large(piece.index, piece.tensor.detach())

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
        indices = {pieces[position].index for position in self._big}
        self._large = {index: buffer for index, buffer in self._large.items() if index in indices}

    def _copy_large(self, index, source: torch.Tensor) -> torch.Tensor:
        buffer = self._large.get(index)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._large[index] = torch.empty(source.shape, dtype=source.dtype)
        buffer.copy_(source)
        return buffer
