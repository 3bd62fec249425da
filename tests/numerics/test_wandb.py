"""--wandb-project / --wandb-exp-name / --wandb-save-dir: the TensorBoard scalars go to a Weights &
Biases run; a missing package stops the run before any process group exists.

wandb is not installed in the test environment: a stand-in module records what the writer sends
(``wandb.init`` arguments and ``run.log`` calls), so these tests check this project's side only."""

import sys
import types

import pytest

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.training import training
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 --lr 1e-3 "
        "--micro-batch-size 2 --global-batch-size 4 --log-interval 1 --eval-iters 0 --train-iters 2")


class _RecordingRun:
    def __init__(self, **kwargs):
        self.init_kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        assert not self.finished, "logged after finish()"
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_scalars_go_to_the_wandb_run(monkeypatch, tmp_path):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: runs.append(_RecordingRun(**kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = parse_args((TINY + f" --wandb-project proj --wandb-exp-name exp "
                                f"--wandb-save-dir {tmp_path}/wb").split(), world_size=1)
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
             pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
             log=lambda line: None)
    (run,) = runs
    assert run.init_kwargs["project"] == "proj" and run.init_kwargs["name"] == "exp"
    assert run.init_kwargs["dir"] == f"{tmp_path}/wb" and (tmp_path / "wb").is_dir()
    assert run.init_kwargs["config"]["training"]["train_iters"] == 2
    tags_by_step = {}
    for step, values in run.logged:
        tags_by_step.setdefault(step, set()).update(values)
    assert sorted(tags_by_step) == [1, 2]
    assert tags_by_step[1] == {"learning-rate", "batch-size", "lm loss", "loss-scale",
                               "grad-norm"}
    assert run.finished  # the run is finished at the end of training


def test_missing_wandb_fails_before_any_process_group(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError

    def no_process_group(*args, **kwargs):
        raise AssertionError("initialize_megatron must not run")
    monkeypatch.setattr(training, "initialize_megatron", no_process_group)
    config = parse_args((TINY + " --wandb-project proj").split(), world_size=1)
    with pytest.raises(ValueError, match="--wandb-project needs the wandb package"):
        pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                 pretrain_gpt.forward_step, log=lambda line: None)
