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

from typing import Callable

import torch


class StagingBuffers:
    """Reused CPU buffers for one rank's pieces (see the module docstring)."""

    def __init__(self):
        self._layout: tuple = ()
        self._flat: dict = {}    # dtype -> flat CPU buffer of the small pieces of that dtype
        self._views: dict = {}   # piece index -> its view into a flat buffer
        self._large: dict = {}   # piece index -> its own CPU buffer

    def stage(self, pieces, is_small: Callable[[object], bool]) -> None:
        """Replace each piece's tensor by its copy in this rank's buffers (``is_small(piece)``:
        copied into the flat buffer of its dtype, else into a buffer of its own)."""
        small = [piece for piece in pieces if is_small(piece)]
        layout = tuple((piece.index, tuple(piece.tensor.shape), piece.tensor.dtype)
                       for piece in small)
        if layout != self._layout:
            self._allocate(small)
            self._layout = layout
        for dtype, flat in self._flat.items():
            sources = [piece.tensor.detach().reshape(-1) for piece in small
                       if piece.tensor.dtype == dtype]
            if all(source.device.type == "cpu" for source in sources):
                torch.cat(sources, out=flat)
            else:  # one transfer from the accelerator
                flat.copy_(torch.cat([source.to(sources[0].device) for source in sources]))
        for piece in small:
            piece.tensor = self._views[piece.index]
        large = {piece.index for piece in pieces if not is_small(piece)}
        self._large = {index: buffer for index, buffer in self._large.items() if index in large}
        for piece in pieces:
            if piece.index in large:
                piece.tensor = self._copy_large(piece.index, piece.tensor.detach())

    def _allocate(self, small: list) -> None:
        sizes: dict = {}
        for piece in small:
            sizes[piece.tensor.dtype] = sizes.get(piece.tensor.dtype, 0) + piece.tensor.numel()
        self._flat = {dtype: torch.empty(total, dtype=dtype) for dtype, total in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        self._views = {}
        for piece in small:
            dtype, numel = piece.tensor.dtype, piece.tensor.numel()
            self._views[piece.index] = \
                self._flat[dtype][offsets[dtype]:offsets[dtype] + numel].view(piece.tensor.shape)
            offsets[dtype] += numel

    def _copy_large(self, index, source: torch.Tensor) -> torch.Tensor:
        buffer = self._large.get(index)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._large[index] = torch.empty(source.shape, dtype=source.dtype)
        buffer.copy_(source)
        return buffer
