"""Megatron-LM flags that change training or its operation, each shown to take effect (every test
fails if its flag were parsed and then ignored). One process, tiny model, mock data."""

import os

import functools
import pytest
import torch

import pretrain_gpt
from data_helpers import uneven_loss_mask_datasets
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 4 --log-interval 1 "
        "--lr-decay-style linear --train-iters 6 --eval-interval 100 --eval-iters 1")


def _run(extra: str):
    config = parse_args(f"{TINY} {extra}".split(), world_size=1)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      checkpointing=Checkpointer(config, log=lines.append), log=lines.append)
    return result, lines


def _learning_rates(result) -> list[float]:
    return [record.learning_rate for record in result.history]


@pytest.fixture
def saved_at_3(tmp_path):
    """A run with --lr 1e-3 decaying linearly to 0 over 6 iterations, saved at iteration 3."""
    save = tmp_path / "ckpt"
    first, _ = _run(f"--lr 1e-3 --min-lr 0 --save {save} --exit-interval 3")
    assert first.exited_early
    straight, _ = _run("--lr 1e-3 --min-lr 0")
    return save, _learning_rates(straight)


def test_use_checkpoint_opt_param_scheduler_takes_the_checkpoints_schedule(saved_at_3):
    save, straight = saved_at_3
    resumed, _ = _run(f"--lr 5e-2 --min-lr 1e-2 --load {save} "
                      f"--use-checkpoint-opt_param-scheduler")
    assert _learning_rates(resumed) == pytest.approx(straight[3:], rel=1e-12)


def test_without_it_the_flags_schedule_is_used_and_the_difference_logged(saved_at_3):
    save, straight = saved_at_3
    resumed, lines = _run(f"--lr 5e-2 --min-lr 1e-2 --load {save}")
    rates = _learning_rates(resumed)
    assert all(rate >= 1e-2 for rate in rates) and rates != pytest.approx(straight[3:])
    assert any("schedule of the checkpoint differs" in line and "max_lr" in line
               for line in lines)
    _, lines = _run(f"--lr 5e-2 --min-lr 1e-2 --load {save} --override-opt_param-scheduler")
    assert not any("schedule of the checkpoint differs" in line for line in lines)


def test_the_two_scheduler_flags_contradict_each_other():
    with pytest.raises(ValueError, match="contradict"):
        parse_args(f"{TINY} --lr 1e-3 --use-checkpoint-opt_param-scheduler "
                   f"--override-opt_param-scheduler".split(), world_size=1)


@pytest.fixture
def restore_determinism(monkeypatch):
    """--deterministic-mode changes process-wide state; put it back after the test."""
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield monkeypatch
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_deterministic_mode_twice_gives_identical_losses(restore_determinism):
    torch.use_deterministic_algorithms(False)
    first, _ = _run("--lr 1e-3 --deterministic-mode")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["NCCL_ALGO"] == "Ring"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    second, _ = _run("--lr 1e-3 --deterministic-mode")
    losses = [[record.losses["lm loss"] for record in run.history] for run in (first, second)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_deterministic_mode_refuses_a_nondeterministic_environment(restore_determinism):
    restore_determinism.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ValueError, match="NCCL_ALGO='Tree'"):
        _run("--lr 1e-3 --deterministic-mode")
    restore_determinism.setenv("NCCL_ALGO", "Ring")
    restore_determinism.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        _run("--lr 1e-3 --deterministic-mode")


def test_save_retain_interval_keeps_its_multiples_and_the_latest(tmp_path):
    save = tmp_path / "ckpt"
    _, lines = _run(f"--lr 1e-3 --save {save} --save-interval 1 --save-retain-interval 4 "
                    f"--train-iters 6")
    kept = sorted(path.name for path in save.iterdir() if path.name.startswith("iter_"))
    assert kept == ["iter_0000004", "iter_0000006"]
    assert any("not kept by --save-retain-interval 4" in line for line in lines)
    # Without the flag every saved checkpoint stays.
    other = tmp_path / "all"
    _run(f"--lr 1e-3 --save {other} --save-interval 2 --train-iters 6")
    assert sorted(p.name for p in other.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000006"]


def _group_lrs(result) -> dict:
    """name -> the lr of the param group holding it, after training."""
    optimizer = result.components.optimizer.optimizer
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    return {name: lr_of[id(param)] for chunk in result.components.model_chunks
            for name, param in chunk.named_parameters()}


def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule():
    flags = ("--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 "
             "--untie-embeddings-and-output-weights")
    plain, _ = _run(flags)
    decoupled, _ = _run(f"{flags} --decoupled-lr 4e-3 --decoupled-min-lr 4e-4")
    scheduler = decoupled.components.lr_scheduler
    expected_decoupled = scheduler.get_lr(param_group={"max_lr": 4e-3, "min_lr": 4e-4})
    lrs = _group_lrs(decoupled)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert lrs[name] == pytest.approx(expected_decoupled) and lrs[name] > 1e-4, name
    assert lrs["embedding.position_embeddings.weight"] == pytest.approx(scheduler.get_lr())
    assert lrs["decoder.layers.0.mlp.linear_fc1.weight"] == pytest.approx(scheduler.get_lr())
    assert set(_group_lrs(plain).values()) == {scheduler.get_lr()}
    # The updates differ: the embedding moved with the larger learning rate.
    assert [r.losses["lm loss"] for r in plain.history][:2] == \
        [r.losses["lm loss"] for r in decoupled.history][:2]  # lr 0 at the first step
    assert [r.losses["lm loss"] for r in plain.history][3:] != \
        [r.losses["lm loss"] for r in decoupled.history][3:]


def test_decoupled_min_lr_without_decoupled_lr_is_refused():
    with pytest.raises(ValueError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse_args(f"{TINY} --lr 1e-3 --decoupled-min-lr 1e-5".split(), world_size=1)


def test_step_batch_size_schedule_changes_the_global_batch_at_its_threshold():
    # Thresholds count tokens: 256 tokens = 16 samples of --seq-length 16.
    flags = "--lr 1e-3 --train-samples 40"
    flags = flags.split() + ["--step-batch-size-schedule", "0:4 256:8"]
    config = parse_args(TINY.replace("--global-batch-size 4 ", "").replace(
        "--train-iters 6 ", "").split() + flags, world_size=1)
    assert config.training.train_iters == 7  # 4 batches of 4 samples, then 3 of 8
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lines.append)
    sizes = [int(line.split("global batch size:")[1].split("|")[0])
             for line in lines if "global batch size:" in line]
    assert sizes == [4, 4, 4, 4, 8, 8, 8]
    assert result.state.consumed_train_samples == 40


@pytest.mark.parametrize("schedule, message", [
    ("64:4 256:8", "the first threshold must be 0"),
    ("0:4 0:8", "thresholds must increase"),
    ("0:4 256:5", "not divisible by --micro-batch-size"),
    ("0:4 x:8", "is not a number")])
def test_a_bad_step_schedule_is_refused_with_the_reason(schedule, message):
    argv = TINY.replace("--global-batch-size 4 ", "").split() + [
        "--lr", "1e-3", "--step-batch-size-schedule", schedule]
    with pytest.raises(ValueError, match=message):
        parse_args(argv, world_size=1)


def test_step_schedule_and_global_batch_size_exclude_each_other():
    with pytest.raises(ValueError, match="give only one"):
        parse_args(TINY.split() + ["--lr", "1e-3", "--step-batch-size-schedule", "0:4"],
                   world_size=1)


def test_eval_global_batch_size_sets_the_validation_batch():
    flags = "--lr 1e-3 --eval-interval 3 --eval-iters 2"
    plain, _ = _run(flags)
    larger, _ = _run(f"{flags} --eval-global-batch-size 8")
    assert plain.state.consumed_valid_samples == 2 * 2 * 4 + 2 * 4  # 2 runs + the final one
    assert larger.state.consumed_valid_samples == 3 * 2 * 8
    plain_loss = [losses["lm loss"] for _, losses in plain.validation]
    larger_loss = [losses["lm loss"] for _, losses in larger.validation]
    assert plain_loss != larger_loss  # other samples were evaluated
    with pytest.raises(ValueError, match="--eval-global-batch-size 5 is not divisible"):
        parse_args(f"{TINY} {flags} --eval-global-batch-size 5".split(), world_size=1)


# A dataset whose samples carry loss masks of different lengths (odd samples: 3 tokens).
_uneven_datasets = functools.partial(uneven_loss_mask_datasets, period=2, remainder=1, kept=3)


def _losses_with_uneven_masks(extra: str):
    config = parse_args(f"{TINY} --lr 1e-2 --attention-dropout 0 --hidden-dropout 0 {extra}"
                        .split(), world_size=1)
    result = pretrain(config, pretrain_gpt.model_provider, _uneven_datasets,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      log=lambda _: None)
    return [record.losses["lm loss"] for record in result.history]


def test_calculate_per_token_loss_weighs_every_token_equally():
    # One micro-batch of 4 samples: its mean over the loss mask is the per-token loss.
    whole = _losses_with_uneven_masks("--micro-batch-size 4")
    # Four micro-batches of one sample (masks of 15 and 3 tokens): the mean of their means
    # over-weighs the short samples' tokens; the per-token loss is the same as in one batch.
    per_token = _losses_with_uneven_masks("--micro-batch-size 1 --calculate-per-token-loss")
    averaged = _losses_with_uneven_masks("--micro-batch-size 1")
    assert per_token == pytest.approx(whole, rel=1e-5)
    assert averaged[0] != pytest.approx(whole[0], rel=1e-3)
    assert averaged[1:] != pytest.approx(whole[1:], rel=1e-3)


def test_per_token_loss_changes_nothing_when_every_token_counts():
    plain, _ = _run("--lr 1e-3")
    per_token, _ = _run("--lr 1e-3 --calculate-per-token-loss")
    assert [r.losses["lm loss"] for r in per_token.history] == \
        [r.losses["lm loss"] for r in plain.history]
