"""Counter-based dropout: masks that are the same in every parallel layout.

This replaces Megatron's ``CudaRNGStatesTracker``. Megatron keeps a separate, rank-specific RNG
stream for dropout inside the tensor-parallel region, which makes TP=2 *a* valid model but not the
*same* model as TP=1, and says nothing about pipeline or Chimera layouts. Here a dropout mask has no
RNG state at all: each element's keep/drop bit is a pure function

    bits = hash(seed, layer number, site, global sample id, element coordinates in the FULL tensor)
    keep = bits >= round(p * 2**32)

so any rank that holds any slice of any sample computes exactly the unsplit model's mask for that
slice: TP ranks compute their attention heads' slice, pipeline stages and Chimera's two replicas of a
stage compute identical masks for a sample, data-parallel ranks identify samples by their global id,
and activation recomputation reproduces the masks for free. There is no RNG state to save in a
checkpoint either: the seed and the global sample ids (which the training loop supplies) are enough.

The hash is 32-bit integer mixing with int64 torch ops (see :meth:`CounterBasedDropout.random_bits`
for the exact recipe). Every intermediate value stays below 2**63 (a 32-bit value times a constant
below 2**31), so no signed overflow happens and CPU and CUDA give identical bits.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

MASK32 = 0xFFFFFFFF

# Dropout sites: which dropout of a layer a mask belongs to (part of the hash key).
SITE_EMBEDDING = 0          # after word + position embedding (layer number 0)
SITE_ATTENTION_PROBS = 1    # on the attention probabilities (inside the TP region)
SITE_ATTENTION_OUTPUT = 2   # on the attention block's output before the residual add
SITE_MLP_OUTPUT = 3         # on the MLP block's output before the residual add


def stable_seed(*parts) -> int:
    """A 63-bit integer derived from ``parts`` by SHA-256 (unlike ``hash()``, equal in every process)."""
    text = "\x1f".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2 ** 63 - 1)


def mix32(value):
    """Bijective 32-bit avalanche mix; works on python ints and int64 tensors alike.

    The shift/multiply constants are a published low-bias 32-bit hash (C. Wellons' hash-prospector);
    both multipliers are below 2**31, so a 32-bit value times one of them stays below 2**63.
    """
    value = value ^ (value >> 16)
    value = (value * 0x21F0AAAD) & MASK32
    value = value ^ (value >> 15)
    value = (value * 0x735A2D97) & MASK32
    return value ^ (value >> 15)


def _mix32_in_place(values: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` on an int64 tensor in place (``scratch``: same shape); 3x faster on big masks."""
    torch.bitwise_right_shift(values, 16, out=scratch)
    values.bitwise_xor_(scratch)
    values.mul_(0x21F0AAAD).bitwise_and_(MASK32)
    torch.bitwise_right_shift(values, 15, out=scratch)
    values.bitwise_xor_(scratch)
    values.mul_(0x735A2D97).bitwise_and_(MASK32)
    torch.bitwise_right_shift(values, 15, out=scratch)
    return values.bitwise_xor_(scratch)


def _absorb64(state, value):
    """Fold a non-negative value below 2**63 into a 32-bit hash state, low word then high word."""
    state = mix32(state ^ (value & MASK32))
    return mix32(state ^ (value >> 32))


def _linear_indices(full_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int],
                    device) -> torch.Tensor:
    """Row-major index, in the full per-sample tensor, of every element of the local block."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    for dim, (full, start, length) in enumerate(zip(full_shape, offsets, shape)):
        if start < 0 or start + length > full:
            raise ValueError(f"block [{start}, {start + length}) of dimension {dim} lies outside "
                             f"the full size {full}")
        coordinate = torch.arange(start, start + length, dtype=torch.int64, device=device)
        index = index.unsqueeze(-1) * full + coordinate
    return index


@dataclass(frozen=True)
class CounterBasedDropout:
    """Stateless dropout whose masks depend only on (seed, layer, site, sample, coordinates).

    One instance per model (built from the model seed); call :meth:`keep_mask` or :meth:`apply`.
    """

    seed: int

    def _site_state(self, layer_number: int, site: int) -> int:
        state = _absorb64(mix32(0x9E3779B9), self.seed & (2 ** 63 - 1))
        state = mix32(state ^ (layer_number & MASK32))
        return mix32(state ^ (site & MASK32))

    def random_bits(self, layer_number: int, site: int, sample_ids: torch.Tensor,
                    full_shape: Sequence[int], offsets: Optional[Sequence[int]] = None,
                    shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Uniform 32-bit values (int64 tensor ``[b, *shape]``) for the block of the full tensor.

        ``full_shape`` is the shape of ONE sample's full (unsharded) tensor; the local block starts
        at ``offsets`` (default zeros) and has ``shape`` (default ``full_shape``). Recipe, with
        ``mix`` = :func:`mix32` and every value a 32-bit word::

            site   = mix(mix(mix(mix(mix(0x9E3779B9) ^ seed_lo) ^ seed_hi) ^ layer) ^ site_id)
            s      = mix(mix(site ^ sample_lo) ^ sample_hi)      # per sample
            t      = mix(s ^ 0x68E31DA4)                          # per sample, second key
            u      = mix(index_lo ^ s)        # index: row-major position in the full tensor
            u      = mix(u ^ index_hi)        # only when the full tensor has > 2**32 elements
            bits   = mix(u ^ t)

        The second key ``t`` keeps masks of different samples unrelated (with ``s`` alone, one
        sample's mask would be a XOR-permutation of another's).
        """
        offsets = tuple(offsets) if offsets is not None else (0,) * len(full_shape)
        shape = tuple(shape) if shape is not None else tuple(full_shape)
        if not len(full_shape) == len(offsets) == len(shape):
            raise ValueError("full_shape, offsets and shape must have the same length")
        sample_ids = sample_ids.to(torch.int64)
        if bool((sample_ids < 0).any()):
            raise ValueError("sample ids must be non-negative global sample indices")
        state = torch.full_like(sample_ids, self._site_state(layer_number, site))
        first_key = _absorb64(state, sample_ids).view(-1, *([1] * len(shape)))
        second_key = mix32(first_key ^ 0x68E31DA4)
        index = _linear_indices(full_shape, offsets, shape, sample_ids.device)
        # The element-wise part works in place on one [b, *shape] buffer plus one scratch buffer.
        bits = torch.bitwise_xor(index & MASK32, first_key)
        scratch = torch.empty_like(bits)
        _mix32_in_place(bits, scratch)
        if math.prod(full_shape) > 2 ** 32:
            _mix32_in_place(bits.bitwise_xor_(index >> 32), scratch)
        return _mix32_in_place(bits.bitwise_xor_(second_key), scratch)

    def keep_mask(self, probability: float, layer_number: int, site: int,
                  sample_ids: torch.Tensor, full_shape: Sequence[int],
                  offsets: Optional[Sequence[int]] = None,
                  shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Boolean keep-mask ``[b, *shape]``: each element is dropped with ``probability``."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1], got {probability}")
        threshold = round(probability * 2 ** 32)
        bits = self.random_bits(layer_number, site, sample_ids, full_shape, offsets, shape)
        return bits >= threshold

    def apply(self, tensor: torch.Tensor, probability: float, layer_number: int, site: int,
              sample_ids: torch.Tensor, full_shape: Optional[Sequence[int]] = None,
              offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Dropout on ``tensor`` laid out ``[b, *per-sample block]``; kept values scaled by 1/(1-p).

        ``full_shape``/``offsets`` place the block in the full per-sample tensor (default: the block
        is the whole tensor).
        """
        if probability == 0.0:
            return tensor
        if probability == 1.0:
            return tensor * 0.0
        block = tuple(tensor.shape[1:])
        full_shape = tuple(full_shape) if full_shape is not None else block
        mask = self.keep_mask(probability, layer_number, site, sample_ids.to(tensor.device),
                              full_shape, offsets, block)
        return tensor * mask.to(tensor.dtype) * (1.0 / (1.0 - probability))

    def apply_to_hidden(self, hidden: torch.Tensor, probability: float, layer_number: int,
                        site: int, sample_ids: torch.Tensor) -> torch.Tensor:
        """Dropout on a replicated hidden state in Megatron's ``[s, b, h]`` layout."""
        if probability == 0.0:
            return hidden
        return self.apply(hidden.transpose(0, 1), probability, layer_number, site,
                          sample_ids).transpose(0, 1)


def attention_dropout_seed(model_seed: int, layer_number: int, tp_rank: int,
                           first_sample: int) -> int:
    """Seed of the fused attention dropout of one layer on one TP rank for one micro-batch.

    Megatron draws attention dropout inside the tensor-parallel region from a separate RNG stream
    per TP rank (``model-parallel-rng``: seed + 2718 + tp_rank), so the heads on different TP ranks
    get independent masks. Here the stream is reseeded per (layer, TP rank, micro-batch's first
    global sample id): masks differ per TP rank as in Megatron, and a recomputed forward or the
    other Chimera replica of a stage draws the same mask without any RNG state to save.
    """
    return stable_seed(model_seed, "attention-dropout", layer_number, tp_rank, first_sample)


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device):
    """Run the block with ``device``'s default generator seeded with ``seed``, then restore it."""
    device = torch.device(device)
    is_cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if is_cuda else None
    with torch.random.fork_rng(devices=[index] if is_cuda else [], device_type="cuda"):
        if is_cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        yield


@dataclass(frozen=True)
class DropoutContext:
    """What a forward pass needs to draw dropout masks.

    ``dropout``: the counter-based generator; ``sample_ids``: global sample ids ``[b]``;
    ``enabled``: training mode; ``first_sample``: the micro-batch's first global sample id (a
    python int, keys the fused attention dropout's stream); ``layout_invariant_attention``: draw
    attention-dropout masks from the counter-based hash instead (--layout-invariant-attention-dropout);
    ``sequence_shard``: under sequence parallelism, (first position, full sequence length) of the
    block of the sequence this rank's hidden states hold (None: the whole sequence).
    """

    dropout: CounterBasedDropout
    sample_ids: torch.Tensor
    enabled: bool
    first_sample: int = 0
    layout_invariant_attention: bool = False
    sequence_shard: Optional[tuple[int, int]] = None

    def hidden(self, hidden: torch.Tensor, probability: float, layer_number: int,
               site: int) -> torch.Tensor:
        """Dropout on a ``[s, b, h]`` hidden state, replicated or (``sequence_shard``) one block
        of the sequence; no-op when disabled."""
        if not self.enabled or probability == 0.0:
            return hidden
        if self.sequence_shard is None:
            return self.dropout.apply_to_hidden(hidden, probability, layer_number, site,
                                                self.sample_ids)
        first, length = self.sequence_shard
        return self.dropout.apply(
            hidden.transpose(0, 1), probability, layer_number, site, self.sample_ids,
            full_shape=(length, hidden.shape[2]), offsets=(first, 0)).transpose(0, 1)
