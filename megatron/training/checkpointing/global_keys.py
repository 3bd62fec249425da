"""This rank's model weights and optimizer state as *pieces of global tensors* (``--ckpt-format
torch_dist``).

Every tensor of a checkpoint is named by what it is in the whole model, not by where it lives:
``model.<parameter name>`` for a weight and ``optimizer.state.<key>.<parameter name>`` for its
optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``), each with the *global* (tensor-parallel
merged) shape. A :class:`Piece` is the box of such a global tensor that this rank holds:

- a tensor-parallel parameter (``tensor_model_parallel``, ``partition_dim``) is the box at offset
  ``tp_rank * local`` along its partition dimension; a replicated one is the whole tensor;
- the two replicas of a Chimera stage, the tied word embedding's copies and the tensor-parallel
  replicas of a replicated parameter give the *same* box (same key and offsets), so only one of
  them is written (torch.distributed.checkpoint removes duplicate boxes across ranks; this module
  removes them within a rank);
- a distributed-optimizer shard is a contiguous range of a segment's flat buffer (the parameters
  of a stage concatenated, see :mod:`megatron.core.distributed.sharded_reducer`); the part of the
  range that falls in each parameter is cut into at most ``2 * ndim - 1`` boxes of that parameter
  (:func:`flat_range_boxes`), each a view of the flat state tensor.

So the same key and global shape describe a parameter's state in every layout (TP, PP, DP,
schedule, distributed optimizer on or off) and loading is "read the boxes this rank needs", which
torch.distributed.checkpoint does. A legacy ``--ckpt-format torch`` file records
:func:`optimizer_state_keys` next to its optimizer state, so that the same keys name it in another
layout (:mod:`.resharding`). No module here touches process groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Optional

import torch

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."


def model_key(name: str) -> str:
    """``model.decoder.layers.0.mlp.linear_fc1.weight``."""
    return MODEL_PREFIX + name


def optimizer_key(state_name: str, name: str) -> str:
    """``optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight``."""
    return f"{OPTIMIZER_PREFIX}{state_name}.{name}"


@dataclass
class Piece:
    """A box ``[offsets, offsets + tensor.shape)`` of the global tensor ``key`` of shape
    ``global_shape``. ``tensor`` is this rank's data (a view where possible); ``copies`` are more
    local tensors holding the same box (filled from ``tensor`` after loading)."""

    key: str
    global_shape: tuple
    offsets: tuple
    tensor: torch.Tensor
    copies: list = field(default_factory=list)

    @property
    def index(self) -> tuple:
        return (self.key, self.offsets)


def flat_range_boxes(shape: tuple, start: int, stop: int) -> list[tuple[int, tuple, tuple]]:
    """The elements ``[start, stop)`` of a contiguous tensor of ``shape`` (row-major) as boxes:
    ``[(flat offset of the box, offsets, sizes), ...]`` in flat order. Each box is contiguous
    in memory, so ``flat[flat_offset:flat_offset + prod(sizes)].view(sizes)`` is the box."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) == 0:
        return [(0, (), ())]
    if len(shape) == 1:
        return [(start, (start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        return [(first_row * inner + flat, (first_row, *offsets), (1, *sizes))
                for flat, offsets, sizes in flat_range_boxes(shape[1:], start - first_row * inner,
                                                             stop - first_row * inner)]
    boxes = []
    full_from, full_to = first_row, last_row + 1
    if start % inner:
        boxes += flat_range_boxes(shape, start, (first_row + 1) * inner)
        full_from = first_row + 1
    tail = []
    if stop % inner:
        tail = flat_range_boxes(shape, last_row * inner, stop)
        full_to = last_row
    if full_to > full_from:
        boxes.append((full_from * inner, (full_from,) + (0,) * (len(shape) - 1),
                      (full_to - full_from, *shape[1:])))
    return boxes + tail


@dataclass(frozen=True)
class TensorPlacement:
    """Where a local tensor of a parameter sits in its global tensor."""

    global_shape: tuple
    offsets: tuple

    def shifted(self, local_offsets: tuple) -> tuple:
        return tuple(base + extra for base, extra in zip(self.offsets, local_offsets))


def partition_dim_of(param: Optional[torch.nn.Parameter]) -> Optional[int]:
    """The dimension a tensor-parallel parameter is split along; None for a replicated one."""
    if param is not None and getattr(param, "tensor_model_parallel", False):
        return param.partition_dim
    return None


def tp_placement(local_shape: tuple, dim: Optional[int], tp_rank: int,
                 tp_size: int) -> TensorPlacement:
    """Where tensor-parallel rank ``tp_rank``'s block of shape ``local_shape`` (split along
    ``dim``; None: replicated, the whole tensor) sits in its global tensor."""
    shape = list(local_shape)
    offsets = [0] * len(shape)
    if dim is not None:
        offsets[dim] = tp_rank * shape[dim]
        shape[dim] *= tp_size
    return TensorPlacement(tuple(shape), tuple(offsets))


def placement(tensor: torch.Tensor, param: Optional[torch.nn.Parameter], tp_rank: int,
              tp_size: int) -> TensorPlacement:
    """The global shape and offsets of ``tensor``, the local (TP shard) value of ``param`` or of a
    state tensor of ``param``'s shape; a replicated (non-TP) tensor is the whole global tensor."""
    return tp_placement(tuple(tensor.shape), partition_dim_of(param), tp_rank, tp_size)


class PieceSet:
    """Pieces keyed by ``(key, offsets)``; a second tensor for the same box becomes a copy."""

    def __init__(self):
        self.by_index: dict = {}

    def add(self, key: str, place: TensorPlacement, tensor: torch.Tensor,
            local_offsets: Optional[tuple] = None) -> None:
        offsets = place.offsets if local_offsets is None else place.shifted(local_offsets)
        index = (key, tuple(offsets))
        if index in self.by_index:
            existing = self.by_index[index]
            if tuple(existing.tensor.shape) != tuple(tensor.shape):
                raise ValueError(f"{key} at offsets {offsets} is held twice on this rank with "
                                 f"shapes {tuple(existing.tensor.shape)} and "
                                 f"{tuple(tensor.shape)}; the model's parameter names are not "
                                 f"unique")
            existing.copies.append(tensor)
        else:
            self.by_index[index] = Piece(key, tuple(place.global_shape), tuple(offsets), tensor)

    def __iter__(self) -> Iterator[Piece]:
        return iter(self.by_index.values())

    def __len__(self) -> int:
        return len(self.by_index)


# ----------------------------------------------------------------------------------------------
# Model weights
# ----------------------------------------------------------------------------------------------

def named_parameters_by_id(model_chunks) -> dict:
    """``{id(parameter): (name, parameter)}`` over every chunk (names are the full model's)."""
    found = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            found.setdefault(id(param), (name, param))
    return found


def model_pieces(model_chunks, states: list, tp_rank: int, tp_size: int) -> PieceSet:
    """Every chunk's state dict ``states[i]`` (``chunk.state_dict()`` to save; tensors of the
    same shapes to read into, loaded with ``load_state_dict`` afterwards) as pieces."""
    pieces = PieceSet()
    for chunk, state in zip(model_chunks, states, strict=True):
        params = dict(chunk.named_parameters())
        for name, value in state.items():
            pieces.add(model_key(name), placement(value, params.get(name), tp_rank, tp_size),
                       value)
    return pieces


# ----------------------------------------------------------------------------------------------
# Optimizer state
# ----------------------------------------------------------------------------------------------

def _is_per_element(value, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _flat_shard_segments(optimizer) -> dict:
    """``{id(shard parameter): (segment parameters, shard start, shard length, unpadded total)}``
    of a distributed optimizer (empty for the replicated one)."""
    found = {}
    for reducer in getattr(optimizer, "sharded_reducers", ()):
        for segment, (start, length, total) in zip(reducer.segments, reducer.shard_ranges()):
            found[id(segment.shard)] = (segment.params, start, length, total)
    return found


def _shard_param_ranges(params: list, start: int, length: int, total: int):
    """For each parameter of a segment that the shard ``[start, start + length)`` overlaps:
    ``(param, first element in the param, last + 1, position in the shard)``."""
    stop = min(start + length, total)
    offset = 0
    for param in params:
        count = param.numel()
        low, high = max(start, offset), min(stop, offset + count)
        if low < high:
            yield param, low - offset, high - offset, low - start
        offset += count


def optimizer_params(optimizer) -> list:
    """The torch optimizer's parameters in its state-dict order."""
    return [param for group in optimizer.optimizer.param_groups for param in group["params"]]


class ParamInfo(NamedTuple):
    """What the global keys need to know of a parameter: its full-model name, its local (this
    tensor-parallel rank's) shape and the dimension it is split along (None: replicated)."""

    name: str
    shape: tuple
    partition_dim: Optional[int]

    def numel(self) -> int:
        return math.prod(self.shape)


def param_info(names: dict, param) -> ParamInfo:
    """The :class:`ParamInfo` of a live parameter (``names``: :func:`named_parameters_by_id`)."""
    if id(param) not in names:
        raise ValueError("an optimizer parameter belongs to no model chunk; the checkpoint "
                         "cannot name its state")
    return ParamInfo(names[id(param)][0], tuple(param.shape), partition_dim_of(param))


def add_flat_shard(pieces: PieceSet, owners: list, segment: tuple, state: dict, numel: int,
                   tp_rank: int, tp_size: int) -> None:
    """Add the optimizer ``state`` of one distributed-optimizer shard to ``pieces``.

    ``owners`` are the :class:`ParamInfo` of the segment's parameters, in flat order; ``segment``
    is ``(shard start, shard length, unpadded total)``. Each per-element state tensor (``numel``
    elements, the shard's flat range) is cut into boxes of the parameters the range covers; a
    scalar is added whole under every covered parameter."""
    start, length, total = segment
    for owner, low, high, position in _shard_param_ranges(owners, start, length, total):
        for state_name, value in state.items():
            key = optimizer_key(state_name, owner.name)
            if _is_per_element(value, numel):
                flat = value.reshape(-1)
                place = tp_placement(owner.shape, owner.partition_dim, tp_rank, tp_size)
                for flat_offset, offsets, sizes in flat_range_boxes(owner.shape, low, high):
                    begin = position + flat_offset - low
                    box = flat[begin:begin + math.prod(sizes)].view(sizes)
                    pieces.add(key, place, box, offsets)
            elif torch.is_tensor(value):
                pieces.add(key, TensorPlacement(tuple(value.shape), (0,) * value.dim()), value)


def add_whole_param_state(pieces: PieceSet, owner: ParamInfo, state: dict, tp_rank: int,
                          tp_size: int) -> None:
    """Add the optimizer ``state`` of one whole (local) parameter to ``pieces``: per-element
    tensors placed like the parameter, scalars whole."""
    for state_name, value in state.items():
        if not torch.is_tensor(value):
            continue
        key = optimizer_key(state_name, owner.name)
        if _is_per_element(value, owner.numel()):
            pieces.add(key, tp_placement(tuple(value.shape), owner.partition_dim, tp_rank,
                                         tp_size), value)
        else:
            pieces.add(key, TensorPlacement(tuple(value.shape), (0,) * value.dim()), value)


def optimizer_state_keys(optimizer, model_chunks) -> list:
    """What each parameter of the torch optimizer's state dict (in its order) is of the global
    keys, as plain tuples (a legacy ``--ckpt-format torch`` file records it next to the state, so
    that any layout can read that state by name): ``("whole", name, local shape, partition dim)``
    or, for a distributed-optimizer shard, ``("flat", start, length, total, ((name, local shape,
    partition dim), ...))`` with the segment's parameters in flat order."""
    names = named_parameters_by_id(model_chunks)
    shards = _flat_shard_segments(optimizer)
    described = []
    for param in optimizer_params(optimizer):
        if id(param) in shards:
            params, start, length, total = shards[id(param)]
            described.append(("flat", start, length, total,
                              tuple(tuple(param_info(names, p)) for p in params)))
        else:
            described.append(("whole", *param_info(names, param)))
    return described


def add_saved_optimizer_state(pieces: PieceSet, states: dict, state_keys: list, tp_rank: int,
                              tp_size: int, wanted=None) -> None:
    """Add a saved torch optimizer's ``states`` ({index: {state name: tensor}}), described by
    :func:`optimizer_state_keys` and saved by tensor-parallel rank ``tp_rank`` of ``tp_size``, to
    ``pieces``; ``wanted(name)`` (default: every name) selects the parameters to keep."""
    for index, entry in enumerate(state_keys):
        state = states.get(index)
        if not state:
            continue
        if entry[0] == "flat":
            _, start, length, total, owners = entry
            owners = [ParamInfo(name, tuple(shape), dim) for name, shape, dim in owners]
            if wanted is None or any(wanted(owner.name) for owner in owners):
                add_flat_shard(pieces, owners, (start, length, total), state, length, tp_rank,
                               tp_size)
        elif wanted is None or wanted(entry[1]):
            add_whole_param_state(pieces, ParamInfo(entry[1], tuple(entry[2]), entry[3]), state,
                                  tp_rank, tp_size)


def fill_from(targets, sources) -> list[str]:
    """Copy into every target piece the parts of the ``sources`` pieces (same key) that overlap
    it, in memory (what torch.distributed.checkpoint does between files and ranks). Sources must
    not overlap each other (a :class:`PieceSet` holds each box once). Returns a line for every
    target that the sources do not cover completely (empty when all are)."""
    by_key: dict = {}
    for source in sources:
        by_key.setdefault(source.key, []).append(source)
    gaps = []
    for target in targets:
        covered = 0
        target_end = [o + n for o, n in zip(target.offsets, target.tensor.shape)]
        for source in by_key.get(target.key, ()):
            low = [max(a, b) for a, b in zip(target.offsets, source.offsets)]
            high = [min(a, b + n) for a, b, n in zip(target_end, source.offsets,
                                                      source.tensor.shape)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            into = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, target.offsets))
            out = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, source.offsets))
            target.tensor[into] = source.tensor[out]
            covered += math.prod(hi - lo for lo, hi in zip(low, high))
        if covered < target.tensor.numel():
            gaps.append(f"{target.key} at offsets {target.offsets}: {covered} of "
                        f"{target.tensor.numel()} elements")
        for copy in target.copies:
            copy.copy_(target.tensor)
    return gaps


def optimizer_pieces(optimizer, model_chunks, tp_rank: int, tp_size: int,
                     states: Optional[dict] = None) -> PieceSet:
    """The optimizer state as pieces keyed by parameter name.

    ``states`` maps each torch-optimizer parameter to its state dict (default: the optimizer's
    own state; for loading, tensors of the right shape to read into). Per-element tensors
    (moments) are placed like their parameter (a distributed-optimizer shard: cut into the boxes of
    the parameters it covers); scalars (``step``) are written whole under every parameter they
    belong to."""
    names = named_parameters_by_id(model_chunks)
    shards = _flat_shard_segments(optimizer)
    states = optimizer.optimizer.state if states is None else states
    pieces = PieceSet()
    for param in optimizer_params(optimizer):
        state = states.get(param)
        if not state:
            continue
        if id(param) in shards:
            params, start, length, total = shards[id(param)]
            add_flat_shard(pieces, [param_info(names, p) for p in params], (start, length, total),
                           state, param.numel(), tp_rank, tp_size)
        else:
            add_whole_param_state(pieces, param_info(names, param), state, tp_rank, tp_size)
    return pieces


def optimizer_state_names(saved_keys, model_chunks) -> dict:
    """``{parameter name: [state names]}`` that a checkpoint holds for this rank's parameters
    (from its keys ``optimizer.state.<state>.<name>``)."""
    names = {name for _, (name, _) in named_parameters_by_id(model_chunks).items()}
    found: dict = {}
    for key in saved_keys:
        if not key.startswith(OPTIMIZER_PREFIX):
            continue
        state_name, _, name = key[len(OPTIMIZER_PREFIX):].partition(".")
        if name in names:
            found.setdefault(name, []).append(state_name)
    return found


def empty_optimizer_states(optimizer, model_chunks, saved: dict) -> dict:
    """``{torch-optimizer parameter: {state name: empty tensor}}`` to read a checkpoint into.

    ``saved`` maps ``optimizer.state.*`` keys to ``(global shape, dtype)``. Per-element state is
    shaped like the parameter (or the shard); a scalar keeps its saved shape. Parameters the
    checkpoint holds no state for get none (their optimizer starts afresh)."""
    names = named_parameters_by_id(model_chunks)
    shards = _flat_shard_segments(optimizer)
    state_names = optimizer_state_names(saved, model_chunks)
    states = {}
    for param in optimizer_params(optimizer):
        if id(param) in shards:
            params, start, length, total = shards[id(param)]
            covered = [names[id(owner)][0] for owner, *_ in
                       _shard_param_ranges(params, start, length, total)]
            owner_names = covered or [names[id(params[0])][0]]
        else:
            owner_names = [names[id(param)][0]]
        kinds = state_names.get(owner_names[0])
        if not kinds:
            continue
        state = {}
        for state_name in kinds:
            shape, dtype = saved[optimizer_key(state_name, owner_names[0])]
            if len(shape) == 0:
                state[state_name] = torch.zeros((), dtype=dtype)
            else:
                state[state_name] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        states[param] = state
    return states


def scalar_state_fallbacks(optimizer, model_chunks, states: dict) -> list[Piece]:
    """Scalar state (``step``) of distributed-optimizer shards that cover only padding: read from
    the first parameter of their segment (every parameter of a stage steps together)."""
    names = named_parameters_by_id(model_chunks)
    shards = _flat_shard_segments(optimizer)
    found = []
    for param, state in states.items():
        if id(param) not in shards:
            continue
        params, start, length, total = shards[id(param)]
        if any(True for _ in _shard_param_ranges(params, start, length, total)):
            continue
        for state_name, value in state.items():
            if value.dim() == 0:
                found.append(Piece(optimizer_key(state_name, names[id(params[0])][0]), (), (),
                                   value))
    return found
