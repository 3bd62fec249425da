"""--no-save-optim and --no-save-rng: checkpoints without optimizer state (and LR schedule) or RNG
states; loading one needs --no-load-optim / --no-load-rng, else the error names what is missing
and the flag."""

import os

import pytest
import torch

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.core.runtimes import NoPipelineRuntime
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer, checkpoint_file, read_tracker
from megatron.training.training import TrainingState, pretrain, setup_model_and_optimizer

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --lr 3e-3 "
        "--lr-warmup-iters 2 --train-iters 5 --eval-iters 0 --ckpt-format torch")  # legacy layout


def _config(extra: str):
    return parse_args(f"{TINY} {extra}".split(), world_size=1)


def _run(extra: str):
    config = _config(extra)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      checkpointing=Checkpointer(config, log=lines.append), log=lines.append)
    return result, lines


def _load(save_dir, flags: str):
    config = _config(f"--load {save_dir} {flags}")
    device = torch.device("cpu")
    parallel_state = ParallelState.single_process()
    components = setup_model_and_optimizer(
        config, parallel_state, NoPipelineRuntime(config, parallel_state, device),
        pretrain_gpt.model_provider, device)
    return components, Checkpointer(config, log=lambda _: None).load(components)


def _tensor_names(value, prefix=""):
    """Every path to a tensor inside a nested payload."""
    if isinstance(value, torch.Tensor):
        return [prefix]
    if isinstance(value, dict):
        return [name for key, item in value.items()
                for name in _tensor_names(item, f"{prefix}/{key}")]
    if isinstance(value, (list, tuple)):
        return [name for index, item in enumerate(value)
                for name in _tensor_names(item, f"{prefix}/{index}")]
    return []


@pytest.fixture(scope="module")
def saved_without_both(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("no_save") / "ckpt"
    result, lines = _run(f"--save {save_dir} --exit-interval 3 --no-save-optim --no-save-rng")
    return save_dir, result, lines


def test_files_hold_no_optimizer_or_rng_state(saved_without_both):
    save_dir, result, lines = saved_without_both
    assert read_tracker(str(save_dir)) == 3
    assert any("without optimizer state and LR schedule and RNG states" in line for line in lines)
    payload = torch.load(checkpoint_file(str(save_dir), 3, 0, 0, 1), weights_only=True)
    assert payload["optimizer"] is None and payload["opt_param_scheduler"] is None
    assert payload["rng_state"] is None and "gradient_reducer_state" not in payload
    # the only tensors left are the model's weights
    assert sorted(_tensor_names(payload)) == sorted(
        f"/model/{name}" for name in result.components.model_chunks[0].state_dict())
    assert sorted(os.listdir(save_dir / "iter_0000003" / "mp_rank_00")) == ["model_optim_rng.pt"]


@pytest.mark.parametrize("flags,missing,fix", [
    ("", "no optimizer state (it was saved with --no-save-optim)", "pass --no-load-optim"),
    ("--no-load-optim", "no RNG state (it was saved with --no-save-rng)", "pass --no-load-rng"),
    ("--no-load-rng", "no optimizer state", "pass --no-load-optim"),
])
def test_loading_what_was_not_saved_is_an_error_naming_the_flag(saved_without_both, flags,
                                                                missing, fix):
    save_dir, _, _ = saved_without_both
    with pytest.raises(RuntimeError) as error:
        _load(save_dir, flags)
    assert missing in str(error.value) and fix in str(error.value)
    assert "model_optim_rng.pt" in str(error.value)


@pytest.mark.parametrize("flags", ["--no-load-optim --no-load-rng", "--finetune"])
def test_loading_with_the_flags_restores_the_weights(saved_without_both, flags):
    save_dir, result, _ = saved_without_both
    components, state = _load(save_dir, flags)
    for name, value in components.model_chunks[0].state_dict().items():
        assert torch.equal(value, result.components.model_chunks[0].state_dict()[name]), name
    assert len(components.optimizer.optimizer.state) == 0
    assert components.lr_scheduler.num_steps == 0
    expected = TrainingState() if flags == "--finetune" else TrainingState(
        iteration=3, consumed_train_samples=24, consumed_valid_samples=0)
    assert state == expected


def test_resume_without_optimizer_state_trains_on(tmp_path):
    """--no-save-optim alone: the RNG states are saved and restored, the optimizer starts afresh,
    and training continues from iteration 3 to the end."""
    save_dir = tmp_path / "ckpt"
    _run(f"--save {save_dir} --exit-interval 3 --no-save-optim")
    payload = torch.load(checkpoint_file(str(save_dir), 3, 0, 0, 1), weights_only=True)
    assert payload["optimizer"] is None and payload["rng_state"] is not None
    with pytest.raises(RuntimeError, match="--no-load-optim"):
        _run(f"--load {save_dir}")
    resumed, lines = _run(f"--load {save_dir} --no-load-optim")
    assert any(f"loading checkpoint from {save_dir} at iteration 3" in line for line in lines)
    assert [record.iteration for record in resumed.history] == [4, 5]
    assert all(torch.isfinite(torch.tensor(r.losses["lm loss"])) for r in resumed.history)


def test_distributed_optimizer_writes_no_shards_with_no_save_optim(tmp_path):
    save_dir = tmp_path / "ckpt"
    _run(f"--save {save_dir} --exit-interval 3 --use-distributed-optimizer --no-save-optim")
    assert sorted(os.listdir(save_dir / "iter_0000003" / "mp_rank_00")) == ["model_optim_rng.pt"]
    _, state = _load(save_dir, "--use-distributed-optimizer --no-load-optim")
    assert state.iteration == 3
