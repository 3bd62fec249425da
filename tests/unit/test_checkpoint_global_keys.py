"""The boxes a distributed-optimizer shard is cut into (``global_keys.flat_range_boxes``): for
every shape and flat range they cover exactly the range's elements, each once, each contiguous in
memory; and a tensor-parallel shard's placement in its global tensor."""

import itertools
import math

import torch

from megatron.training.checkpointing.global_keys import flat_range_boxes, placement


def _covered(shape, boxes) -> torch.Tensor:
    counts = torch.zeros(shape, dtype=torch.int64)
    for _, offsets, sizes in boxes:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        counts[index] += 1
    return counts.reshape(-1)


def test_boxes_cover_every_flat_range_exactly_once_and_are_contiguous():
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (1, 6)]:
        numel = math.prod(shape)
        flat = torch.arange(numel)
        for start, stop in itertools.combinations(range(numel + 1), 2):
            boxes = flat_range_boxes(shape, start, stop)
            expected = torch.zeros(numel, dtype=torch.int64)
            expected[start:stop] = 1
            assert torch.equal(_covered(shape, boxes), expected), (shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            for flat_offset, offsets, sizes in boxes:  # the box is flat[o:o + n] viewed as sizes
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                view = flat[flat_offset:flat_offset + math.prod(sizes)].view(sizes)
                assert torch.equal(view, flat.view(shape)[index]), (shape, start, stop)


def test_empty_range_and_scalars():
    assert flat_range_boxes((3, 4), 5, 5) == []
    assert flat_range_boxes((), 0, 1) == [(0, (), ())]


def test_tensor_parallel_shards_sit_at_their_rank_offset():
    param = torch.nn.Parameter(torch.zeros(4, 6))
    param.tensor_model_parallel, param.partition_dim = True, 1
    place = placement(param, param, tp_rank=2, tp_size=3)
    assert place.global_shape == (4, 18) and place.offsets == (0, 12)
    replicated = torch.nn.Parameter(torch.zeros(4))
    assert placement(replicated, replicated, 2, 3).offsets == (0,)
    assert placement(replicated, replicated, 2, 3).global_shape == (4,)


def _pieces_by_index(pieces) -> dict:
    return {piece.index: (piece.global_shape, piece.tensor) for piece in pieces}


def test_saved_state_keys_map_a_files_optimizer_state_to_the_live_optimizers_keys():
    """A legacy file's optimizer state, read back through the ``state_keys`` saved next to it,
    gives exactly the pieces (keys, global shapes, offsets, values) of the live optimizer: for a
    whole tensor-parallel parameter and for a distributed-optimizer shard whose flat range starts
    inside one parameter and ends inside the next."""
    import types

    from megatron.training.checkpointing.global_keys import (PieceSet, add_saved_optimizer_state,
                                                            optimizer_pieces,
                                                            optimizer_state_keys)

    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    weight = chunk[0].weight  # column-parallel style: split along dim 0
    weight.tensor_model_parallel, weight.partition_dim = True, 0
    segment = [chunk[1].weight, chunk[1].bias]  # 8 + 2 elements, flat
    shard = torch.nn.Parameter(torch.zeros(6))  # elements [3, 9) of the segment's 10
    reducer = types.SimpleNamespace(segments=[types.SimpleNamespace(params=segment, shard=shard)],
                                    shard_ranges=lambda: [(3, 6, 10)])
    adam = torch.optim.Adam([weight, chunk[0].bias, shard])
    for param in (weight, chunk[0].bias, shard):
        param.grad = torch.randn(param.shape)
    adam.step()
    optimizer = types.SimpleNamespace(optimizer=adam, sharded_reducers=[reducer])
    live = optimizer_pieces(optimizer, [chunk], tp_rank=1, tp_size=2)
    state_keys = optimizer_state_keys(optimizer, [chunk])
    assert state_keys[0] == ("whole", "0.weight", (4, 3), 0)
    assert state_keys[2][:4] == ("flat", 3, 6, 10)
    saved = PieceSet()
    add_saved_optimizer_state(saved, adam.state_dict()["state"], state_keys, tp_rank=1, tp_size=2)
    live_boxes, saved_boxes = _pieces_by_index(live), _pieces_by_index(saved)
    assert live_boxes.keys() == saved_boxes.keys()
    assert ("optimizer.state.exp_avg.0.weight", (4, 0)) in live_boxes  # TP rank 1 of 2 rows
    assert ("optimizer.state.exp_avg.1.bias", (0,)) in live_boxes  # the range's tail
    for index, (shape, tensor) in live_boxes.items():
        assert saved_boxes[index][0] == shape, index
        assert torch.equal(saved_boxes[index][1], tensor), index
