"""--exit-signal-handler: a SIGTERM during an iteration saves at its end and exits normally; the
resumed run reproduces an uninterrupted one bitwise."""

import os
import signal

import torch

import pretrain_gpt
from megatron.core.parallel_state import ParallelState
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer, read_tracker
from megatron.training.signal_handler import ExitSignalHandler
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --lr 3e-3 --min-lr 3e-4 "
        "--lr-decay-style cosine --lr-warmup-iters 2 --train-iters 5 --eval-iters 0")


def _run(extra: str, forward_step=pretrain_gpt.forward_step):
    config = parse_args(f"{TINY} {extra}".split(), world_size=1)
    lines = []
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      forward_step, parallel_state=ParallelState.single_process(),
                      checkpointing=Checkpointer(config, log=lines.append), log=lines.append)
    return result, lines


def _sigterm_during_call(number: int):
    """A forward step that sends this process SIGTERM on its ``number``-th call."""
    calls = []

    def forward_step(batch, model):
        calls.append(1)
        if len(calls) == number:
            os.kill(os.getpid(), signal.SIGTERM)
        return pretrain_gpt.forward_step(batch, model)
    return forward_step


def _records(result):
    return [(r.iteration, r.losses["lm loss"], r.learning_rate, r.grad_norm)
            for r in result.history]


def test_sigterm_saves_at_the_end_of_the_iteration_and_resume_is_bitwise(tmp_path):
    straight, _ = _run("")
    # 4 micro-batches per iteration: call 6 is inside iteration 2
    first, lines = _run(f"--save {tmp_path} --exit-signal-handler", _sigterm_during_call(6))
    assert first.exited_early and first.state.iteration == 2
    assert read_tracker(str(tmp_path)) == 2
    assert "exiting program at iteration 2" in lines
    second, _ = _run(f"--load {tmp_path} --save {tmp_path}")
    assert _records(first) + _records(second) == _records(straight)
    for got, want in zip(second.components.model_chunks[0].parameters(),
                         straight.components.model_chunks[0].parameters()):
        assert torch.equal(got, want)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored


def test_handler_records_and_restores():
    before = signal.getsignal(signal.SIGTERM)
    with ExitSignalHandler() as handler:
        assert not handler.received
        os.kill(os.getpid(), signal.SIGTERM)
        assert handler.received
    assert signal.getsignal(signal.SIGTERM) is before
