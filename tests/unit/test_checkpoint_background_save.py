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
from megatron.training.checkpointing.staging import StagingBuffers, source_signature


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


def test_kept_pieces_are_restaged_only_while_their_sources_are_the_same_tensors():
    """A save whose sources have the signature of the kept pieces' refills them (nothing is
    built); a tensor replaced (new memory, same shape), reshaped, of another dtype, or a state
    that appeared gives another signature, and the pieces are built anew."""
    model = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    optimizer = [{"exp_avg": torch.randn(4, 3), "step": torch.tensor(1.0)}, None]

    def signature(model_state=None, optimizer_states=None):
        return source_signature([model_state or model], optimizer_states or optimizer)

    staging = StagingBuffers()
    pieces = [_piece(name, tensor) for name, tensor in
              [*model.items(), *optimizer[0].items()]]
    staging.stage(pieces, _small, signature=signature())
    model["w"].add_(1)  # training goes on in place: the same tensors
    optimizer[0]["step"].add_(1)
    kept = staging.restage(signature())
    assert kept is pieces and staging.generation == 1
    assert torch.equal(kept[0].tensor, model["w"]) and torch.equal(kept[3].tensor,
                                                                   optimizer[0]["step"])
    assert kept[0].tensor.data_ptr() != model["w"].data_ptr()  # still a copy
    assert staging.restage(signature(), packed_here={("w", (0, 0))}) is None
    changed = [{**model, "w": model["w"].clone()},            # same shape, new memory
               {**model, "w": model["w"].view(3, 4)},         # another shape
               {**model, "w": model["w"].double()},           # another dtype
               {**model, "extra": torch.zeros(2)}]            # another entry
    for state in changed:
        assert staging.restage(signature(model_state=state)) is None
    assert staging.restage(signature(optimizer_states=[optimizer[0], {"step": 1}])) is None
    assert staging.restage(source_signature([model], None)) is None  # no optimizer state
    unsigned = StagingBuffers()
    unsigned.stage([_piece("w", model["w"])], _small)
    assert unsigned.restage(source_signature([{"w": model["w"]}], None)) is None


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


def test_a_packed_object_is_kept_only_when_its_buffers_are_the_staged_ones():
    """A packed object whose buffers are the staged buffers (refilled in place at every save) is
    kept and reused; one that had to copy the pieces (a snapshot of that moment) is not."""
    def finish(pieces, kept):
        planner = PieceSavePlanner([], {}, packed=pieces, packed_key="packed_tensors.rank_00000",
                                   packed_objects=kept)
        planner.set_up_planner({}, is_coordinator=True)
        local = planner.create_local_plan()
        central, _ = planner.create_global_plan([local])
        planner.finish_plan(central[0])
        return planner.objects["packed_tensors.rank_00000"]

    sources = [torch.randn(3), torch.randn(2, 2)]
    loose = [_piece(name, tensor) for name, tensor in zip("ab", sources)]
    kept: dict = {}
    finish(loose, kept)
    assert kept == {}  # copied by torch.cat: never reused
    staged = [_piece(name, tensor) for name, tensor in zip("ab", sources)]
    StagingBuffers().stage(staged, _small, packed_here={piece.index for piece in staged})
    first = finish(staged, kept)
    assert len(kept) == 1 and finish(staged, kept) is first
    assert first["buffers"][0].data_ptr() == staged[0].tensor.data_ptr()


def test_the_packed_object_is_written_as_it_is_and_read_back_as_before():
    """The packed object travels as its own bytes (no torch.save); loading reads that form and
    the torch.save form of checkpoints written before; a damaged header is named."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from megatron.training.checkpointing.dcp_io import (RAW_PACKED_MAGIC, PieceLoadPlanner,
                                                       raw_packed_bytes, read_raw_packed)

    pieces = [_piece("w", torch.randn(3, 2)), _piece("half", torch.randn(4).bfloat16()),
              _piece("mask", torch.tensor([True, False])), _piece("none", torch.zeros(0)),
              _piece("count", torch.tensor([4, 2], dtype=torch.int64))]
    packed = pack_boxes(pieces)
    data = raw_packed_bytes(packed)
    assert data.startswith(RAW_PACKED_MAGIC)
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("packed"),
                    dest_offsets=torch.Size((0,)), storage_index=MetadataIndex("packed"),
                    storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)))
    saved_before = io.BytesIO()
    torch.save(packed, saved_before)
    for form in (data, saved_before.getvalue()):
        planner = PieceLoadPlanner([], ["packed"])
        planner.load_bytes(item, io.BytesIO(form))
        loaded = {key: tensor for key, _, _, tensor in unpack_boxes(planner.objects["packed"])}
        for piece in pieces:
            assert loaded[piece.key].dtype == piece.tensor.dtype and \
                torch.equal(loaded[piece.key], piece.tensor), piece.key
    with pytest.raises(CheckpointError, match="unknown dtype 'nonsense'"):
        read_raw_packed(data.replace(b'"bfloat16"', b'"nonsense"'))
    with pytest.raises(CheckpointError, match="shorter"):
        read_raw_packed(data[:-4])


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


def _save_with(job, plans, tensors: dict, iteration: int):
    """One background save of ``tensors`` (``{key: tensor}``; 1-D ones under 100 elements packed)
    through ``job`` in one process; returns the files it recorded."""
    pieces = [_piece(key, tensor.clone()) for key, tensor in tensors.items()]
    packed = [piece for piece in pieces if _small(piece)]
    planner = PieceSavePlanner([piece for piece in pieces if not _small(piece)],
                               {"progress": {"iteration": iteration}}, packed=packed,
                               packed_key="packed_tensors.rank_00000")
    published = []
    job.publish = lambda files: published.append(files) or []
    outcome = job.write_and_complete(planner, plans)
    assert outcome.error is None, outcome.error
    return published[0]


def _read_back(directory: str, files: dict, shapes: dict) -> dict:
    """Every tensor of a checkpoint directory (packed and DCP items), read as loading does."""
    import torch.distributed.checkpoint as dcp

    from megatron.training.checkpointing.dcp_io import PieceLoadPlanner, VerifyingReader
    from megatron.training.checkpointing.torch_dist import read_packed

    reader = VerifyingReader(directory, files)
    packed = {piece.key: piece.tensor for piece in read_packed(directory, files,
                                                               reader.read_metadata())}
    targets = [_piece(key, torch.empty(shape)) for key, shape in shapes.items()
               if key not in packed]
    planner = PieceLoadPlanner(targets, ["progress"])
    dcp.load({}, storage_reader=VerifyingReader(directory, files), planner=planner,
             no_dist=True)
    return {**packed, **{piece.key: piece.tensor for piece in targets}}


def test_a_reused_save_plan_writes_what_a_fresh_one_does_and_a_new_shape_plans_again(
        tmp_path, monkeypatch):
    """Background saves reuse DCP's plan while the local plan is unchanged (no planning: DCP's
    save is not called); their files load; a tensor of another shape (a resumed run with other
    flags, the optimizer state appearing) is planned again, never written with the stale plan."""
    import torch.distributed.checkpoint as dcp

    from megatron.training.checkpointing.background import PlanCache, SaveJob

    planned = []
    dcp_save = dcp.save
    monkeypatch.setattr(dcp, "save", lambda *args, **kwargs: planned.append(1) or
                        dcp_save(*args, **kwargs))
    plans = PlanCache()
    tensors = {"model.w": torch.randn(20, 10), "model.b": torch.randn(10),
               "optimizer.state.step.model.w": torch.tensor(3.0)}
    for iteration in (1, 2, 3):
        directory = tmp_path / f"iter_{iteration}"
        job = SaveJob(0, None, True, str(directory), None)
        tensors = {key: value + 1 for key, value in tensors.items()}
        files = _save_with(job, plans, tensors, iteration)
        assert sorted(files) == [".metadata", "__0_0.distcp"]
        loaded = _read_back(str(directory), files, {k: v.shape for k, v in tensors.items()})
        assert all(torch.equal(loaded[key], tensors[key]) for key in tensors)
    assert len(planned) == 1 and plans.central_plan is not None  # planned once, reused twice
    reshaped = {**tensors, "model.w": torch.randn(20, 12), "model.b": torch.randn(12)}
    directory = tmp_path / "iter_4"
    files = _save_with(SaveJob(0, None, True, str(directory), None), plans, reshaped, 4)
    assert len(planned) == 2  # the changed shapes were planned again
    loaded = _read_back(str(directory), files, {k: v.shape for k, v in reshaped.items()})
    assert all(torch.equal(loaded[key], reshaped[key]) for key in reshaped)


def test_a_save_into_a_crashed_saves_directory_keeps_only_its_own_files(tmp_path):
    """What an interrupted save of the same iteration left (another world size's files, an old
    ``.metadata``) is not published with the new checkpoint."""
    from megatron.training.checkpointing.background import (PlanCache, SaveJob,
                                                            remove_own_leftovers)

    directory = tmp_path / "iter_7.tmp"
    directory.mkdir()
    for name in ("__0_0.distcp", "__5_0.distcp", ".metadata", "metadata.json"):
        (directory / name).write_bytes(b"left by a crashed save")
    remove_own_leftovers(str(directory), 0)
    assert sorted(p.name for p in directory.iterdir()) == ["__5_0.distcp"]
    files = _save_with(SaveJob(0, None, True, str(directory), None), PlanCache(),
                       {"model.w": torch.randn(20, 10)}, 7)
    assert sorted(p.name for p in directory.iterdir()) == sorted(files) == \
        [".metadata", "__0_0.distcp"]


def test_the_rng_state_round_trips_as_saved_now_and_as_saved_before():
    """Python's RNG state is saved as one tensor (fewer objects for torch.save to pickle); the
    tuple that checkpoints written before hold still restores."""
    import random

    from megatron.training.checkpointing.state import capture_rng_state, restore_rng_state

    random.seed(11)
    random.gauss(0, 1)  # a cached second gaussian is part of the state
    state, buffer = capture_rng_state(), io.BytesIO()
    torch.save(state, buffer)
    expected = [random.random(), random.gauss(0, 1)]
    buffer.seek(0)
    restore_rng_state(torch.load(buffer, weights_only=True))
    assert [random.random(), random.gauss(0, 1)] == expected
    random.seed(12)
    old_form = list(random.getstate())  # what a checkpoint written before held
    expected = random.random()
    restore_rng_state({**state, "random": old_form})
    assert random.random() == expected


def test_the_sizes_and_crcs_recorded_while_writing_are_those_of_the_files(tmp_path):
    """A background save records its files' sizes and CRC-32s from the bytes it wrote (not read
    back): they equal the files' own, so a file damaged afterwards still fails its check."""
    from megatron.training.checkpointing import torch_dist
    from megatron.training.checkpointing.background import PlanCache, SaveJob
    from megatron.training.checkpointing.files import CheckpointError, _verify_file

    tensors = {"model.w": torch.randn(20, 10), "model.b": torch.randn(10)}
    plans = PlanCache()
    for iteration in (1, 2):  # planned by DCP, then with the cached plan
        directory = tmp_path / f"iter_{iteration}"
        files = _save_with(SaveJob(0, None, True, str(directory), None), plans, tensors,
                           iteration)
        for name, record in files.items():
            assert record == torch_dist.file_record(str(directory / name)), name
    data = directory / "__0_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        _verify_file(str(data), files["__0_0.distcp"])


def test_the_crc32_in_use_is_zlibs_checksum(tmp_path):
    """Checkpoint CRC-32s use ISA-L's when installed (faster): the same checksum as zlib's, in
    one call and continued over blocks, so files recorded either way verify either way."""
    import zlib

    from megatron.training.checkpointing.files import crc32, file_crc32

    data = torch.randn(100_003).numpy().tobytes()
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[5000:], crc32(data[:5000])) == zlib.crc32(data)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert file_crc32(str(path)) == zlib.crc32(data)
