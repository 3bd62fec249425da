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
