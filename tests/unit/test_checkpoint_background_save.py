"""The parts of ``--async-save`` that need no processes: the reused staging buffers
(``checkpointing/staging.py``), the packed boxes' assignment in DCP's global planning and the
packed object's single storage (``dcp_io.PieceSavePlanner``), and a planner that fails the save."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

from megatron.training.checkpointing.dcp_io import PieceSavePlanner, pack_boxes, unpack_boxes
from megatron.training.checkpointing.files import CheckpointError
from megatron.training.checkpointing.global_keys import Piece
from megatron.training.checkpointing.staging import StagingBuffers


def _piece(key: str, tensor: torch.Tensor) -> Piece:
    return Piece(key, tuple(tensor.shape), (0,) * tensor.dim(), tensor)


def _small(piece) -> bool:
    return piece.tensor.numel() < 100


def test_staging_copies_into_buffers_kept_from_save_to_save():
    weight, bias, step = torch.randn(4, 3), torch.randn(3), torch.tensor(7, dtype=torch.int64)
    large = torch.randn(20, 10)
    sources = [weight, bias, step, large]
    staging = StagingBuffers()
    first = [_piece(name, tensor) for name, tensor in zip("wbsl", sources)]
    staging.stage(first, _small)
    for piece, source in zip(first, sources):
        assert torch.equal(piece.tensor, source) and piece.tensor.shape == source.shape
        assert piece.tensor.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    # the float pieces share one flat buffer, exactly filled; the int64 step has its own
    assert first[0].tensor.untyped_storage().data_ptr() == \
        first[1].tensor.untyped_storage().data_ptr()
    assert first[0].tensor.untyped_storage().nbytes() == (12 + 3) * 4
    copied = [piece.tensor.clone() for piece in first]
    for source in sources:  # training goes on: the copies keep the saved values
        source.add_(1)
    assert all(torch.equal(piece.tensor, value) for piece, value in zip(first, copied))
    second = [_piece(name, tensor) for name, tensor in zip("wbsl", sources)]
    staging.stage(second, _small)
    for old, new, source in zip(first, second, sources):
        assert new.tensor.data_ptr() == old.tensor.data_ptr()  # the same memory, new values
        assert torch.equal(new.tensor, source)
    # another set of pieces (e.g. the optimizer state appeared): new buffers of the right size
    third = [_piece(name, tensor) for name, tensor in zip("wbsxl", [*sources[:3],
                                                                    torch.randn(5), large])]
    staging.stage(third, _small)
    assert third[0].tensor.untyped_storage().nbytes() == (12 + 3 + 5) * 4
    assert torch.equal(third[3].tensor, third[3].tensor) and torch.equal(third[4].tensor, large)


class _Plans:
    """Local plans of four ranks as Chimera PP 4 holds its stages: ranks 0 and 3 hold stages 0
    and 3, ranks 1 and 2 stages 1 and 2 (every small box on two ranks)."""

    def __init__(self):
        stage = {s: [_piece(f"model.s{s}.p{i}", torch.full((i + 1,), float(s)))
                     for i in range(6)] for s in range(4)}
        holds = {0: (0, 3), 1: (1, 2), 2: (2, 1), 3: (3, 0)}
        self.planners = []
        for rank in range(4):
            pieces = [_piece(p.key, p.tensor.clone()) for s in holds[rank] for p in stage[s]]
            planner = PieceSavePlanner([], {"progress": {"iteration": 1}}, packed=pieces,
                                       packed_key=f"packed_tensors.rank_{rank:05d}")
            planner.set_up_planner({}, is_coordinator=rank == 0)
            self.planners.append(planner)
        self.local = [planner.create_local_plan() for planner in self.planners]


def test_each_packed_box_is_written_once_by_one_of_its_holders_balanced():
    plans = _Plans()
    central, metadata = plans.planners[0].create_global_plan(plans.local)
    packed_by = {}
    written = [0] * 4
    for rank, plan in enumerate(central):
        plans.planners[rank].finish_plan(plan)
        key = f"packed_tensors.rank_{rank:05d}"
        boxes = unpack_boxes(plans.planners[rank].objects.get(key, []))
        for name, _, _, tensor in boxes:
            assert name not in packed_by, f"{name} packed by ranks {packed_by[name]}, {rank}"
            packed_by[name] = rank
            written[rank] += tensor.numel()
        assert any(item.index.fqn == key for item in plan.items) == bool(boxes)
        assert (key in metadata.state_dict_metadata) == bool(boxes)
    assert sorted(packed_by) == sorted(f"model.s{s}.p{i}" for s in range(4) for i in range(6))
    assert all(packed_by[name] in {0: (0, 3), 1: (1, 2), 2: (1, 2), 3: (0, 3)}[int(name[7])]
               for name in packed_by)
    assert max(written) - min(written) <= 6  # each replica pair shares its stages' writing


def test_the_packed_object_is_one_buffer_per_dtype_and_round_trips():
    pieces = [_piece("w", torch.randn(3, 2)), _piece("step", torch.tensor(5.0)),
              _piece("count", torch.tensor([4, 2], dtype=torch.int64)),
              Piece("b", (8,), (4,), torch.arange(4.0))]
    packed = pack_boxes(pieces)
    assert [buffer.dtype for buffer in packed["buffers"]] == [torch.float32, torch.int64]
    assert [buffer.numel() for buffer in packed["buffers"]] == [6 + 1 + 4, 2]
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    loaded = unpack_boxes(torch.load(buffer, weights_only=True))
    assert [(key, shape, offsets) for key, shape, offsets, _ in loaded] == \
        [("w", [3, 2], [0, 0]), ("step", [], []), ("b", [8], [4]), ("count", [2], [0])]
    by_key = {key: tensor for key, _, _, tensor in loaded}
    for piece in pieces:
        assert torch.equal(by_key[piece.key], piece.tensor) and \
            by_key[piece.key].dtype == piece.tensor.dtype
    old_form = [("w", [3, 2], [0, 0], pieces[0].tensor)]  # checkpoints written before
    assert unpack_boxes(old_form) is old_form


def test_a_planner_with_an_error_fails_its_local_plan_naming_it():
    planner = PieceSavePlanner([], {}, error="rank 2 could not copy its state: out of memory")
    planner.set_up_planner({}, is_coordinator=False)
    with pytest.raises(CheckpointError, match="out of memory"):
        planner.create_local_plan()
    with pytest.raises(ValueError, match="packed_key"):
        PieceSavePlanner([], {}, packed=[_piece("a", torch.zeros(2))])
    plain = PieceSavePlanner([_piece("big", torch.zeros(3))], {"o": 1})
    plain.set_up_planner({}, is_coordinator=True)
    assert [item.type for item in plain.create_local_plan().items] == \
        [WriteItemType.SHARD, WriteItemType.BYTE_IO]
