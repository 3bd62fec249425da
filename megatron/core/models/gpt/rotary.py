"""Rotary position embedding (RoPE) with Megatron's options.

The first ``rotary_dim = int(head_dim * rotary_percent)`` channels of every query and key head are
rotated by the angle ``position * base ** (-2 i / rotary_dim)`` of their channel pair ``i``; the
rest pass through. Pairs are the two halves of the rotated channels (``(j, j + rotary_dim/2)``,
GPT-NeoX's and Hugging Face Llama's convention) or, with ``interleaved``, neighbours ``(2i, 2i+1)``
(Meta's original Llama convention). Angles are computed in float32 (as Megatron and Hugging Face
do; float64 for float64 activations) and cos/sin cast to the activations' dtype; they depend only on
the position, so every TP, PP, sequence-parallel or Chimera layout rotates exactly like the single
process.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Rotates ``[s, b, heads, head_dim]`` tensors by their position (no parameters)."""

    def __init__(self, head_dim: int, rotary_percent: float, base: float, interleaved: bool):
        rotary_dim = int(head_dim * rotary_percent)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary-percent {rotary_percent} of head size {head_dim} gives "
                             f"{rotary_dim} rotated channels; it must be a positive even number "
                             f"(choose --rotary-percent so that head size x percent is even)")
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.interleaved = interleaved

    def angles(self, sequence_length: int, device, offset: int = 0,
               dtype=torch.float32) -> torch.Tensor:
        """``[s, rotary_dim]`` angles (``dtype``) of positions ``offset .. offset + s - 1``, each
        pair's angle at both of its channels."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device)
        inverse_frequency = 1.0 / (self.base ** (exponents.to(dtype) / self.rotary_dim))
        positions = torch.arange(offset, offset + sequence_length, dtype=dtype, device=device)
        frequencies = torch.outer(positions, inverse_frequency)  # [s, rotary_dim / 2]
        if self.interleaved:
            return frequencies.repeat_interleave(2, dim=-1)
        return torch.cat((frequencies, frequencies), dim=-1)

    def _rotate_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """(a, b) -> (-b, a) for every channel pair."""
        if self.interleaved:
            first, second = x[..., 0::2], x[..., 1::2]
            return torch.stack((-second, first), dim=-1).flatten(-2)
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)

    def __call__(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``x`` ``[s, b, heads, head_dim]`` at positions ``offset .. offset + s - 1``, rotated."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        angles = self.angles(x.shape[0], x.device, offset, dtype)[:, None, None, :]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rotated, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        rotated = rotated * cos + self._rotate_pairs(rotated) * sin
        return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated
