"""Checkpointing in one process: exact resume (bitwise), the files on disk, the load flags, layout
mismatches, corrupt files, failing saves, and ranks that hold two model chunks."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

import pretrain_gpt
from megatron.core.distributed import GradientReducer
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import (NO_CHECKPOINT_MESSAGE, TRACKER_FILENAME, Checkpointer,
                                             checkpoint_file, describe_layout, file_crc32,
                                             read_tracker)
from megatron.core.runtimes import (NoPipelineRuntime, forward_backward_no_pipelining,
                                       model_parameters)
from megatron.training.training import TrainingState, pretrain, setup_model_and_optimizer

# Dropout on (default 0.1), warm-up then cosine decay, active clipping, validation every 2
# iterations: every piece of state that a resume must restore is exercised.
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 "
        "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 0.5 "
        "--train-iters 6 --eval-interval 2 --eval-iters 1 --ckpt-format torch")  # the legacy layout
# fp16 with a dynamic scale whose growth window (2) straddles the resume point at iteration 3.
FP16 = "--fp16 --initial-loss-scale 1024 --loss-scale-window 2 --hysteresis 1"


class TwoChunkRuntime(NoPipelineRuntime):
    """A rank holding two model chunks (layers 0 and 1), as a Chimera rank holds two stages; the
    chunks run back to back in one process, so training equals the one-chunk model."""

    def __init__(self, config, parallel_state, device):
        super().__init__(config, parallel_state, device)

    def build_model_chunks(self, model_provider):
        first = model_provider(self.config, self.parallel_state, pre_process=True,
                               post_process=False, layer_range=range(0, 1))
        second = model_provider(self.config, self.parallel_state, pre_process=False,
                                post_process=True, layer_range=range(1, 2))
        return [first, second]

    def build_gradient_reducers(self, model_chunks):
        return [GradientReducer(model_parameters(model_chunks), None, divide_by=1)]

    def forward_backward(self, *, model_chunks, **kwargs):
        return forward_backward_no_pipelining(model=_Chained(*model_chunks), **kwargs)


class _Chained(torch.nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, tokens, labels, *, sample_ids):
        hidden = self.first(tokens, sample_ids=sample_ids)
        return self.second(hidden, labels, sample_ids=sample_ids)


def _config(extra: str = ""):
    return parse_args(f"{TINY} {extra}".split(), world_size=1)


def _run(extra: str = "", runtime_class=None):
    """pretrain with the checkpointing hook; returns (result, log lines)."""
    config = _config(extra)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      runtime_class=runtime_class,
                      checkpointing=Checkpointer(config, log=lines.append), log=lines.append)
    return result, lines


def _params(result) -> dict:
    return {f"{index}.{name}": value.detach().clone()
            for index, chunk in enumerate(result.components.model_chunks)
            for name, value in chunk.state_dict().items()}


def _records(result) -> list:
    return [(r.iteration, r.losses["lm loss"], r.learning_rate, r.grad_norm, r.loss_scale,
             r.skipped) for r in result.history]


def _assert_resume_equals_straight(save_dir, extra="", runtime_class=None):
    straight, _ = _run(extra, runtime_class)
    first, _ = _run(f"{extra} --save {save_dir} --exit-interval 3", runtime_class)
    assert first.exited_early and read_tracker(str(save_dir)) == 3
    second, lines = _run(f"{extra} --load {save_dir} --save {save_dir}", runtime_class)
    assert any(f"loading checkpoint from {save_dir} at iteration 3" in line for line in lines)
    # bitwise: same floats, not approximately the same
    assert _records(first) + _records(second) == _records(straight)
    assert first.validation + second.validation == straight.validation
    assert dataclasses.astuple(second.state) == dataclasses.astuple(straight.state)
    resumed, reference = _params(second), _params(straight)
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    return straight, first, second


@pytest.mark.parametrize("precision", ["", FP16], ids=["fp32", "fp16-dynamic-scale"])
def test_resume_reproduces_straight_training_bitwise(tmp_path, precision):
    straight, _, _ = _assert_resume_equals_straight(tmp_path / "ckpt", precision)
    if precision:  # the scale grew across the resume point, so the scaler state mattered
        scales = [r.loss_scale for r in straight.history]
        assert len(set(scales)) > 1, scales


def test_two_chunks_per_rank_resume_bitwise_and_use_full_model_names(tmp_path):
    extra = "--untie-embeddings-and-output-weights"  # no tied copy across the two chunks
    _assert_resume_equals_straight(tmp_path / "ckpt", extra, TwoChunkRuntime)
    payload = torch.load(checkpoint_file(str(tmp_path / "ckpt"), 6, 0, 0, 1), weights_only=True)
    assert "model" not in payload and {"model0", "model1"} <= payload.keys()
    assert any(name.startswith("embedding.") for name in payload["model0"])
    assert any(name.startswith("decoder.layers.0.") for name in payload["model0"])
    assert all(not name.startswith("decoder.layers.1.") for name in payload["model0"])
    assert any(name.startswith("decoder.layers.1.") for name in payload["model1"])
    assert any(name.startswith("output_layer.") for name in payload["model1"])
    assert payload["layout"]["model_chunks_per_rank"] == 2


def test_files_on_disk_follow_megatron_layout(tmp_path):
    save_dir = tmp_path / "ckpt"
    result, lines = _run(f"--save {save_dir} --save-interval 2 --exit-interval 5")
    assert (save_dir / TRACKER_FILENAME).read_text() == "5\n"
    names = sorted(str(path.relative_to(save_dir)) for path in save_dir.rglob("*"))
    expected = [TRACKER_FILENAME]
    for iteration in (2, 4, 5):
        expected += [f"iter_{iteration:07d}", f"iter_{iteration:07d}/metadata.json",
                     f"iter_{iteration:07d}/mp_rank_00",
                     f"iter_{iteration:07d}/mp_rank_00/model_optim_rng.pt"]
    assert names == sorted(expected)
    assert sum("successfully saved checkpoint at iteration" in line for line in lines) == 3

    path = checkpoint_file(str(save_dir), 4, 0, 0, 1)
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == "megatron-chimera" and payload["format_version"] == 1
    assert (payload["iteration"], payload["consumed_train_samples"],
            payload["consumed_valid_samples"]) == (4, 32, 16)
    assert payload["config"] == dataclasses.asdict(result.components.config)
    assert payload["opt_param_scheduler"]["num_steps"] == 32
    assert payload["optimizer"]["optimizer"]["state"]  # Adam moments are there
    assert len(payload["rng_state"]) == 1  # one data-parallel rank
    assert set(payload["rng_state"][0]) == {"random", "numpy", "torch", "cuda"}
    metadata = json.loads((save_dir / "iter_0000004" / "metadata.json").read_text())
    assert metadata["layout"] == {"tensor_model_parallel_size": 1,
                                  "pipeline_model_parallel_size": 1, "pipeline_schedule": "none",
                                  "model_chunks_per_rank": 1}
    assert metadata["files"] == {"mp_rank_00/model_optim_rng.pt": {
        "size": os.path.getsize(path), "crc32": file_crc32(path)}}


def test_missing_directory_or_tracker_starts_from_scratch(tmp_path):
    straight, _ = _run("--train-iters 3")
    for load_dir in (tmp_path / "does-not-exist", tmp_path):  # no dir; dir without tracker
        result, lines = _run(f"--train-iters 3 --load {load_dir}")
        assert any(NO_CHECKPOINT_MESSAGE in line for line in lines)
        assert _records(result) == _records(straight)


# ---- the load flags, checked on freshly built components ----------------------------------

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A checkpoint of iteration 3 and the run that wrote it."""
    save_dir = tmp_path_factory.mktemp("flags") / "ckpt"
    result, _ = _run(f"--save {save_dir} --exit-interval 3")
    payload = torch.load(checkpoint_file(str(save_dir), 3, 0, 0, 1), weights_only=True)
    return save_dir, result, payload


def _fresh_components(config):
    parallel_state = ParallelState.single_process()
    device = torch.device("cpu")
    runtime = NoPipelineRuntime(config, parallel_state, device)
    return setup_model_and_optimizer(config, parallel_state, runtime,
                                     pretrain_gpt.model_provider, device)


def _load_with(save_dir, flags: str):
    config = _config(f"--load {save_dir} {flags}")
    components = _fresh_components(config)
    torch.manual_seed(999)  # a state different from the saved one
    before = torch.get_rng_state()
    state = Checkpointer(config, log=lambda _: None).load(components)
    return components, state, before


@pytest.mark.parametrize("flags", ["", "--no-load-optim", "--no-load-rng", "--finetune"])
def test_load_flags(saved_run, flags):
    save_dir, result, payload = saved_run
    components, state, rng_before = _load_with(save_dir, flags)
    for name, value in components.model_chunks[0].state_dict().items():  # weights: always
        assert torch.equal(value, result.components.model_chunks[0].state_dict()[name]), name

    loads_optimizer = flags in ("", "--no-load-rng")
    loads_rng = flags in ("", "--no-load-optim")
    optimizer_state = components.optimizer.optimizer.state
    if loads_optimizer:
        saved = result.components.optimizer.optimizer.state
        for param, reference in zip(components.optimizer.params, result.components.optimizer.params):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optimizer_state[param][key], saved[reference][key])
        assert components.lr_scheduler.num_steps == 24
        assert components.optimizer.param_groups[0]["lr"] == \
            result.components.optimizer.param_groups[0]["lr"]
    else:
        assert len(optimizer_state) == 0 and components.lr_scheduler.num_steps == 0
    expected_rng = payload["rng_state"][0]["torch"] if loads_rng else rng_before
    assert torch.equal(torch.get_rng_state(), expected_rng)
    if flags == "--finetune":
        assert state == TrainingState()
    else:
        assert state == TrainingState(iteration=3, consumed_train_samples=24,
                                      consumed_valid_samples=8)


def test_optimizer_settings_come_from_the_current_flags(saved_run):
    save_dir, _, _ = saved_run
    components, _, _ = _load_with(save_dir, "--weight-decay 0.5 --adam-beta2 0.9")
    decayed = [g for g in components.optimizer.param_groups if g["weight_decay"] > 0]
    assert decayed and all(g["weight_decay"] == 0.5 for g in decayed)
    assert all(g["betas"][1] == 0.9 for g in components.optimizer.param_groups)
    assert len(components.optimizer.optimizer.state) > 0  # while the moments were loaded


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("load_optimizer", [True, False], ids=["with-optimizer", "no-load-optim"])
def test_another_layout_resumes_through_the_global_keys(tmp_path, load_optimizer):
    """Saved with one model chunk per rank, resumed with two (another layout): weights and
    optimizer state are read by parameter name, so iterations 4-6 equal the uninterrupted run's;
    without the optimizer state (--no-load-optim) they must not (the check can fail)."""
    extra = "--untie-embeddings-and-output-weights"  # no tied copy across the two chunks
    save_dir = tmp_path / "ckpt"
    straight, _ = _run(extra)
    _run(f"{extra} --save {save_dir} --exit-interval 3")
    flags = "" if load_optimizer else "--no-load-optim"
    resumed, lines = _run(f"{extra} --load {save_dir} --save {save_dir} {flags}",
                          TwoChunkRuntime)
    assert any("resharding from [TP=1, PP=1, schedule=none, 1 model chunk per rank] to [TP=1, "
               "PP=1, schedule=none, 2 model chunks per rank]" in line for line in lines), lines
    losses = [r.losses["lm loss"] for r in resumed.history]
    expected = [r.losses["lm loss"] for r in straight.history[3:]]
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True)]
    if load_optimizer:
        assert max(errors) < 1e-6, (losses, expected)
    else:
        assert max(errors) > 1e-5, (losses, expected)


def test_describe_layout_names_tp_pp_and_schedule():
    assert describe_layout({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                            "pipeline_schedule": "chimera", "chimera_pipelines": 2,
                            "model_chunks_per_rank": 2}) == \
        "TP=2, PP=4, schedule=chimera (2 pipelines), 2 model chunks per rank"


def _copy_checkpoint(saved_run, tmp_path):
    save_dir = tmp_path / "copy"
    shutil.copytree(saved_run[0], save_dir)
    return save_dir, checkpoint_file(str(save_dir), 3, 0, 0, 1)


def _load_error(save_dir) -> str:
    config = _config(f"--load {save_dir}")
    with pytest.raises(RuntimeError) as error:
        Checkpointer(config, log=lambda _: None).load(_fresh_components(config))
    return str(error.value)


def test_truncated_file_is_named(saved_run, tmp_path):
    save_dir, path = _copy_checkpoint(saved_run, tmp_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    message = _load_error(save_dir)
    assert path in message and "truncated" in message


def test_flipped_byte_is_caught_by_the_checksum(saved_run, tmp_path):
    # torch.load itself accepts a flipped byte inside tensor data and returns wrong numbers.
    save_dir, path = _copy_checkpoint(saved_run, tmp_path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    message = _load_error(save_dir)
    assert path in message and "CRC-32" in message


def test_unreadable_file_with_matching_metadata_is_named(saved_run, tmp_path):
    save_dir, path = _copy_checkpoint(saved_run, tmp_path)
    open(path, "wb").write(b"not a checkpoint at all")
    metadata_path = save_dir / "iter_0000003" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["files"]["mp_rank_00/model_optim_rng.pt"] = {"size": os.path.getsize(path),
                                                          "crc32": file_crc32(path)}
    metadata_path.write_text(json.dumps(metadata))
    message = _load_error(save_dir)
    assert path in message and "corrupt or truncated" in message


def test_missing_pieces_are_named(saved_run, tmp_path):
    save_dir, path = _copy_checkpoint(saved_run, tmp_path)
    os.remove(path)
    assert path in _load_error(save_dir) and "missing" in _load_error(save_dir)
    (save_dir / "iter_0000003" / "metadata.json").unlink()
    assert "metadata.json is missing" in _load_error(save_dir)
    (save_dir / TRACKER_FILENAME).write_text("7\n")
    message = _load_error(save_dir)
    assert "names iteration 7" in message and "iter_0000007 does not exist" in message
    (save_dir / TRACKER_FILENAME).write_text("seven\n")
    assert "expected an iteration number" in _load_error(save_dir)


def test_failing_save_raises_and_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    _run(f"--save {save_dir} --exit-interval 3")

    def disk_full(payload, path):
        with open(path, "wb") as handle:
            handle.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing.checkpointer, "save_file", disk_full)
    with pytest.raises(RuntimeError) as error:
        _run(f"--load {save_dir} --save {save_dir} --exit-interval 4")
    assert "No space left on device" in str(error.value) and "unchanged" in str(error.value)
    monkeypatch.undo()
    assert read_tracker(str(save_dir)) == 3
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000003", TRACKER_FILENAME]
    config = _config(f"--load {save_dir}")
    state = Checkpointer(config, log=lambda _: None).load(_fresh_components(config))
    assert state.iteration == 3


def test_saving_an_existing_iteration_replaces_it(tmp_path):
    save_dir = tmp_path / "ckpt"
    _run(f"--save {save_dir} --exit-interval 3")
    # --finetune restarts at iteration 0 from those weights, so it saves iteration 3 again
    # with different weights
    second, _ = _run(f"--load {save_dir} --finetune --save {save_dir} --exit-interval 3")
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000003", TRACKER_FILENAME]
    payload = torch.load(checkpoint_file(str(save_dir), 3, 0, 0, 1), weights_only=True)
    for name, value in second.components.model_chunks[0].state_dict().items():
        assert torch.equal(payload["model"][name], value), name


def test_different_model_flags_are_named(saved_run):
    save_dir, _, _ = saved_run
    config = _config(f"--load {save_dir} --hidden-size 64")
    with pytest.raises(RuntimeError) as error:
        Checkpointer(config, log=lambda _: None).load(_fresh_components(config))
    assert "--hidden-size 32 (this run: 64)" in str(error.value)
    assert "--ffn-hidden-size 128 (this run: 256)" in str(error.value)


def _rewrite_payload(save_dir, path, change):
    """Edit a checkpoint file and record its new size and CRC, as if saved that way."""
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)
    metadata_path = save_dir / "iter_0000003" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["files"]["mp_rank_00/model_optim_rng.pt"] = {"size": os.path.getsize(path),
                                                          "crc32": file_crc32(path)}
    metadata_path.write_text(json.dumps(metadata))


def test_different_optimizer_groups_are_refused_unless_no_load_optim(saved_run, tmp_path):
    save_dir, path = _copy_checkpoint(saved_run, tmp_path)
    _rewrite_payload(save_dir, path,
                     lambda payload: payload["optimizer"]["optimizer"]["param_groups"].pop())
    message = _load_error(save_dir)
    assert path in message and "--no-load-optim" in message
    components, state, _ = _load_with(save_dir, "--no-load-optim")
    assert state.iteration == 3
