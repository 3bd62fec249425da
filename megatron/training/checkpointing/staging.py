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
        self._layout: tuple = ()
        self._flat: dict = {}    # (dtype, packed here) -> flat CPU buffer of such small pieces
        self._views: dict = {}   # piece index -> its view into a flat buffer
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
        small = []
        large = []
        for piece in pieces:
            (small if is_small(piece) else large).append(piece)
        layout = tuple((piece.index, tuple(piece.tensor.shape), piece.tensor.dtype,
                        piece.index in packed_here) for piece in small)
        if layout != self._layout:
            self._allocate(small, packed_here)
            self._layout = layout
        for (dtype, packed), flat in self._flat.items():
            sources = [piece.tensor.detach().reshape(-1) for piece in small
                       if piece.tensor.dtype == dtype and (piece.index in packed_here) == packed]
            if all(source.device.type == "cpu" for source in sources):
                torch.cat(sources, out=flat)
            else:  # one transfer from the accelerator
                flat.copy_(torch.cat([source.to(sources[0].device) for source in sources]))
        for piece in small:
            piece.tensor = self._views[piece.index]
        indices = {piece.index for piece in large}
        self._large = {index: buffer for index, buffer in self._large.items() if index in indices}
        for piece in large:
            piece.tensor = self._copy_large(piece.index, piece.tensor.detach())

    def _allocate(self, small: list, packed_here: set) -> None:
        sizes: dict = {}
        for piece in small:
            group = (piece.tensor.dtype, piece.index in packed_here)
            sizes[group] = sizes.get(group, 0) + piece.tensor.numel()
        self._flat = {group: torch.empty(total, dtype=group[0]) for group, total in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self._views = {}
        for piece in small:
            group, numel = (piece.tensor.dtype, piece.index in packed_here), piece.tensor.numel()
            self._views[piece.index] = \
                self._flat[group][offsets[group]:offsets[group] + numel].view(piece.tensor.shape)
            offsets[group] += numel

    def _copy_large(self, index, source: torch.Tensor) -> torch.Tensor:
        buffer = self._large.get(index)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._large[index] = torch.empty(source.shape, dtype=source.dtype)
        buffer.copy_(source)
        return buffer
