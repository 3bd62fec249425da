"""``--ckpt-format torch_dist`` in one process: the guarantees of the per-rank format hold for it —
exact (bitwise) resume with dropout, fp16 scaling and two chunks per rank; the load flags; corrupt,
truncated and missing files named; a failing save leaving the previous checkpoint and the tracker
untouched; the model flags named when they differ — and either format loads whatever
``--ckpt-format`` this run saves in."""

import dataclasses
import json
import os
import shutil
import threading

import pytest
import torch

from megatron.training.checkpointing import (TRACKER_FILENAME, Checkpointer, read_tracker,
                                             torch_dist)
from test_checkpointing import (FP16, TwoChunkRuntime, _config, _fresh_components, _params,
                                _records, _run)

DIST = "--ckpt-format torch_dist"


def _resume_equals_straight(save_dir, extra="", runtime_class=None, first_format=DIST):
    straight, _ = _run(f"{DIST} {extra}", runtime_class)
    first, _ = _run(f"{first_format} {extra} --save {save_dir} --exit-interval 3", runtime_class)
    assert first.exited_early and read_tracker(str(save_dir)) == 3
    second, lines = _run(f"{DIST} {extra} --load {save_dir} --save {save_dir}", runtime_class)
    assert any(f"loading checkpoint from {save_dir} at iteration 3" in line for line in lines)
    assert _records(first) + _records(second) == _records(straight)  # bitwise
    assert first.validation + second.validation == straight.validation
    assert dataclasses.astuple(second.state) == dataclasses.astuple(straight.state)
    resumed, reference = _params(second), _params(straight)
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    return straight


@pytest.mark.parametrize("precision", ["", FP16], ids=["fp32", "fp16-dynamic-scale"])
def test_resume_reproduces_straight_training_bitwise(tmp_path, precision):
    straight = _resume_equals_straight(tmp_path / "ckpt", precision)
    files = sorted(os.listdir(tmp_path / "ckpt" / "iter_0000003"))
    assert files == [".metadata", "__0_0.distcp", "metadata.json"]
    if precision:
        assert len({r.loss_scale for r in straight.history}) > 1


def test_two_chunks_per_rank_resume_bitwise(tmp_path):
    # untied: this test runtime does not keep a tied embedding's two copies in sync (the pipeline
    # runtimes do; tests/distributed/test_checkpointing_reshard.py covers Chimera's copies)
    _resume_equals_straight(tmp_path / "ckpt", "--untie-embeddings-and-output-weights",
                            TwoChunkRuntime)


def test_distributed_optimizer_resumes_bitwise(tmp_path):
    _resume_equals_straight(tmp_path / "ckpt", "--use-distributed-optimizer")


def test_a_torch_format_checkpoint_still_loads(tmp_path):
    _resume_equals_straight(tmp_path / "ckpt", first_format="--ckpt-format torch")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("dist") / "ckpt"
    result, _ = _run(f"{DIST} --save {save_dir} --exit-interval 3")
    return str(save_dir), result


def _load(save_dir, flags: str = ""):
    config = _config(f"{DIST} --load {save_dir} {flags}")
    components = _fresh_components(config)
    torch.manual_seed(999)
    before = torch.get_rng_state()
    state = Checkpointer(config, log=lambda _: None).load(components)
    return components, state, before


@pytest.mark.parametrize("flags", ["", "--no-load-optim", "--no-load-rng", "--finetune"])
def test_load_flags(saved_run, flags):
    save_dir, result = saved_run
    components, state, rng_before = _load(save_dir, flags)
    for name, value in result.components.model_chunks[0].state_dict().items():
        assert torch.equal(components.model_chunks[0].state_dict()[name], value), name
    has_optimizer = bool(components.optimizer.optimizer.state)
    assert has_optimizer == (flags in ("", "--no-load-rng"))
    if has_optimizer:
        saved = result.components.optimizer.optimizer.state
        for param, reference in zip(components.optimizer.params, result.components.optimizer.params):
            for key, value in saved[reference].items():
                assert torch.equal(components.optimizer.optimizer.state[param][key], value), key
        assert components.lr_scheduler.state_dict() == \
            result.components.lr_scheduler.state_dict()
    rng_restored = not torch.equal(torch.get_rng_state(), rng_before)
    assert rng_restored == (flags in ("", "--no-load-optim"))
    assert state.iteration == (0 if flags == "--finetune" else 3)


def _copy(saved_run, tmp_path) -> str:
    save_dir = str(tmp_path / "copy")
    shutil.copytree(saved_run[0], save_dir)
    return save_dir


def _load_error(save_dir, flags: str = "") -> str:
    config = _config(f"{DIST} --load {save_dir} {flags}")
    with pytest.raises(RuntimeError) as error:
        Checkpointer(config, log=lambda _: None).load(_fresh_components(config))
    return str(error.value)


def test_flipped_byte_in_a_shard_file_is_named(saved_run, tmp_path):
    save_dir = _copy(saved_run, tmp_path)
    path = os.path.join(save_dir, "iter_0000003", "__0_0.distcp")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    message = _load_error(save_dir)
    assert path in message and "CRC-32" in message


def test_truncated_or_missing_files_are_named(saved_run, tmp_path):
    save_dir = _copy(saved_run, tmp_path)
    path = os.path.join(save_dir, "iter_0000003", ".metadata")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    message = _load_error(save_dir)
    assert path in message and "truncated" in message
    os.remove(path)
    message = _load_error(save_dir)
    assert path in message and "missing" in message


def test_not_saved_states_need_the_matching_load_flag(tmp_path):
    save_dir = tmp_path / "ckpt"
    _run(f"{DIST} --save {save_dir} --exit-interval 3 --no-save-optim --no-save-rng")
    assert "--no-load-optim" in _load_error(save_dir)
    assert "--no-load-rng" in _load_error(save_dir, "--no-load-optim")
    _, state, _ = _load(save_dir, "--no-load-optim --no-load-rng")
    assert state.iteration == 3


def test_different_model_flags_are_named(saved_run):
    message = _load_error(saved_run[0], "--hidden-size 64")
    assert "--hidden-size 32 (this run: 64)" in message


def test_failing_save_raises_and_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    _run(f"{DIST} --save {save_dir} --exit-interval 3")

    def disk_full(components, pieces, objects, staging_dir, error=None):
        with open(os.path.join(staging_dir, "__0_0.distcp"), "wb") as handle:
            handle.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch_dist, "write_pieces", disk_full)
    with pytest.raises(RuntimeError) as error:
        _run(f"{DIST} --load {save_dir} --save {save_dir} --exit-interval 4")
    assert "No space left on device" in str(error.value) and "unchanged" in str(error.value)
    monkeypatch.undo()
    assert read_tracker(str(save_dir)) == 3
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000003", TRACKER_FILENAME]
    _, state, _ = _load(save_dir)
    assert state.iteration == 3


def test_metadata_records_the_format_and_every_file(saved_run):
    iteration_dir = os.path.join(saved_run[0], "iter_0000003")
    with open(os.path.join(iteration_dir, "metadata.json")) as handle:
        metadata = json.load(handle)
    assert metadata["ckpt_format"] == "torch_dist"
    assert sorted(metadata["files"]) == [".metadata", "__0_0.distcp"]
    assert metadata["run_layout"]["world_size"] == 1


def test_async_save_every_iteration_resumes_bitwise(tmp_path):
    save_dir = tmp_path / "ckpt"
    straight, _ = _run(DIST)
    first, lines = _run(f"{DIST} --async-save --save {save_dir} --save-interval 1 "
                        f"--exit-interval 3")
    assert any("in the background" in line for line in lines), lines
    assert read_tracker(str(save_dir)) == 3  # the end of training published the last one
    assert sorted(p.name for p in save_dir.iterdir()) == \
        ["iter_0000001", "iter_0000002", "iter_0000003", TRACKER_FILENAME]
    second, _ = _run(f"{DIST} --async-save --load {save_dir} --save {save_dir} "
                     f"--save-interval 1")
    assert _records(first) + _records(second) == _records(straight)
    assert read_tracker(str(save_dir)) == 6


def test_a_background_save_that_never_finishes_leaves_the_previous_checkpoint(tmp_path,
                                                                            monkeypatch):
    """What a kill during a background write leaves: the tracker names the previous iteration,
    whose files are untouched, and it loads. The background job is held after DCP's write, before
    it records its files and publishes (the kill), while training goes on."""
    save_dir = tmp_path / "ckpt"
    _run(f"{DIST} --save {save_dir} --exit-interval 3")
    config = _config(f"{DIST} --async-save --load {save_dir} --save {save_dir}")
    components = _fresh_components(config)
    checkpointer = Checkpointer(config, log=lambda _: None)
    state = checkpointer.load(components)
    state.iteration = 4
    written, release = threading.Event(), threading.Event()
    record_files = torch_dist.own_files

    def held_after_writing(staging_dir, rank, **options):
        written.set()
        assert release.wait(60)
        return record_files(staging_dir, rank, **options)

    monkeypatch.setattr(torch_dist, "own_files", held_after_writing)
    checkpointer.save(components, state)
    assert checkpointer.pending is not None
    assert written.wait(60)
    assert read_tracker(str(save_dir)) == 3  # not before every rank's write finished
    assert (save_dir / "iter_0000004.tmp").is_dir()  # written, never published (the "kill")
    _, loaded, _ = _load(save_dir)
    assert loaded.iteration == 3
    state.iteration = 5  # training goes on meanwhile: the save still publishes iteration 4
    release.set()
    checkpointer.finish(components)  # had it lived: published by now
    assert read_tracker(str(save_dir)) == 4
    assert not (save_dir / "iter_0000004.tmp").exists()
    _, loaded, _ = _load(save_dir)
    assert loaded.iteration == 4


def test_convert_checkpoint_reads_and_writes_both_formats(saved_run, tmp_path):
    """torch_dist -> torch (PP2 files) -> torch_dist: the weights survive both ways, and the
    weights-only torch_dist result loads (with --finetune) and refuses a full resume."""
    from megatron.training.checkpoint_conversion import (TargetLayout, convert_checkpoint,
                                                         merge_full_state, read_checkpoint)
    from tools.convert_checkpoint import main

    save_dir, result = saved_run
    reference = result.components.model_chunks[0].state_dict()
    pp2 = str(tmp_path / "pp2")
    convert_checkpoint(save_dir, pp2, TargetLayout(pipeline_model_parallel_size=2), log=print,
                       ckpt_format="torch")
    assert os.path.isfile(os.path.join(pp2, "iter_0000003", "mp_rank_00_001",
                                       "model_optim_rng.pt"))
    back = str(tmp_path / "back")
    assert main(["--load", pp2, "--save", back]) == 0  # torch_dist: the default
    assert sorted(os.listdir(os.path.join(back, "iter_0000003"))) == \
        [".metadata", "__0_0.distcp", "metadata.json"]
    merged = merge_full_state(read_checkpoint(back))
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(merged[name], value), name
    assert "--finetune or --no-load-optim" in _load_error(back)
    components, state, _ = _load(back, "--finetune")
    assert state.iteration == 0
    for name, value in reference.items():
        assert torch.equal(components.model_chunks[0].state_dict()[name], value), name


def test_saving_and_loading_in_one_process_gives_no_dcp_single_process_warning(tmp_path):
    """DCP warns "assuming the intent is to load in a single process" for every no_dist call;
    ours are on purpose (one process, or each rank reading the packed small tensors itself), and
    the warning was printed by every rank at every resume: it is silenced around those calls."""
    import warnings

    from megatron.training.checkpointing.dcp_io import SINGLE_PROCESS_WARNING

    save_dir = tmp_path / "ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(f"{DIST} --save {save_dir} --exit-interval 3")
        _load(save_dir)
    assert not [w for w in caught if SINGLE_PROCESS_WARNING in str(w.message)]
