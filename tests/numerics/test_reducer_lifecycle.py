"""The gradient-reducer seam holds: a reducer defined in this file, added to a reducer table passed
to the runtime (no module globals are changed), is built by ``--dp-gradient-reducer`` and gets
``attach``, ``after_step``, ``synchronize`` and ``state_dict``/``load_state_dict`` from a real
``pretrain`` run, at the points the training loop documents; its state goes through a checkpoint
and comes back on resume."""

import dataclasses

import pytest
import torch

import pretrain_gpt
from megatron.core.config import ParallelConfig
from megatron.core.distributed import GradientReducer
from megatron.core.distributed.reducers import BUILTIN_REDUCERS
from megatron.core.distributed.reduction import ReducerKind
from megatron.core.parallel_state import ParallelState
from megatron.core.runtimes import NoPipelineRuntime
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer, checkpoint_file, load_file
from megatron.training.training import pretrain

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --lr 3e-3 "
        "--eval-interval 2 --eval-iters 1")


class RecordingReducer(GradientReducer):
    """The exact all-reduce, recording every lifecycle call; its state is a step count and a
    tensor, so that a checkpoint must carry both."""

    has_state = True
    sync_interval = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list = []
        self.optimizer = None
        self.steps = 0
        self.loaded = None

    def attach(self, optimizer) -> None:
        self.optimizer = optimizer
        self.events.append("attach")

    def after_step(self, ok: bool) -> None:
        self.steps += 1
        self.events.append(("step", ok))

    def synchronize(self) -> None:
        self.events.append("sync")

    def state_dict(self) -> dict:
        self.events.append("state")
        return {"steps": self.steps, "marker": torch.full((3,), float(self.steps))}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
        self.steps = state["steps"]
        self.events.append("load")


RECORDING = ReducerKind(
    name="recording", description="all-reduce that records its lifecycle (test only)",
    build=lambda request: RecordingReducer(request.params, request.replica_group,
                                           divide_by=request.divide_by))
TABLE = BUILTIN_REDUCERS.with_kind(RECORDING)


class RecordingRuntime(NoPipelineRuntime):
    reducer_table = TABLE


def _run(extra: str):
    config = parse_args(f"{TINY} {extra}".split(), world_size=1)
    # --dp-gradient-reducer's choices are the built-in table's names; this runtime's table has one
    # more, chosen here as the flag would.
    config.parallel.dp_gradient_reducer = "recording"
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      runtime_class=RecordingRuntime,
                      checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)
    (reducer,) = result.components.gradient_reducers
    assert isinstance(reducer, RecordingReducer)
    return result, reducer


def test_the_built_in_table_is_unchanged_and_is_the_flags_choices():
    choices = next(f for f in dataclasses.fields(ParallelConfig)
                   if f.name == "dp_gradient_reducer").metadata["choices"]
    assert BUILTIN_REDUCERS.names == tuple(choices) == ("allreduce", "a2sgd", "topk", "qsgd")
    assert TABLE.names == ("allreduce", "a2sgd", "topk", "qsgd", "recording")
    with pytest.raises(ValueError, match="unknown gradient reducer 'recording'"):
        BUILTIN_REDUCERS.get("recording")
    with pytest.raises(ValueError, match="already in the table"):
        TABLE.with_kind(RECORDING)


def test_pretrain_drives_the_lifecycle_and_the_state_survives_a_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    # fp16 with too large an initial scale: the first step overflows (after_step sees ok=False).
    # The legacy layout, whose per-rank file the test reads below.
    result, reducer = _run(f"--train-iters 4 --save {save} --save-interval 3 --ckpt-format torch --fp16 "
                           "--initial-loss-scale 1048576 --hysteresis 1 --loss-scale-window 1000")
    assert reducer.optimizer is result.components.optimizer
    oks = [not record.skipped for record in result.history]
    assert oks[0] is False and oks[-1] is True  # both kinds of step happened
    step = [("step", ok) for ok in oks]
    # attach; it 1; it 2 + interval sync + evaluation sync; it 3 + save (sync, state); it 4 +
    # interval sync + evaluation sync; end of training: save (sync, state); the final validation
    # and test evaluations (sync each).
    assert reducer.events == ["attach", step[0], step[1], "sync", "sync", step[2], "sync", "state",
                              step[3], "sync", "sync", "sync", "state", "sync", "sync"]

    payload = load_file(checkpoint_file(str(save), 4, 0, 0, 1))
    (saved,) = payload["gradient_reducer_state"][0]  # data-parallel rank 0, the one reducer
    assert saved["steps"] == 4 and saved["marker"].tolist() == [4.0] * 3

    resumed, fresh = _run(f"--train-iters 5 --load {save} --fp16 "
                          "--initial-loss-scale 1048576 --hysteresis 1 --loss-scale-window 1000")
    assert fresh.events[:2] == ["attach", "load"]
    assert fresh.loaded["steps"] == 4 and fresh.loaded["marker"].tolist() == [4.0] * 3
    assert [record.iteration for record in resumed.history] == [5]
    assert fresh.steps == 5


def test_overlapped_buckets_launch_in_bucket_order_and_are_issued_once_all_launched():
    """A complete bucket waits for the earlier ones (every rank of a group then issues its
    collectives in one order, whatever order its backward produced the gradients in)."""
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    # Buckets follow the reversed parameter order: bucket 0 holds ``second``, bucket 1 ``first``.
    reducer = GradientReducer([first, second], None, bucket_size=1, overlap=True)
    assert [bucket.params for bucket in reducer.buckets] == [[second], [first]]
    sent = []
    reducer.watch_local_gradients(lambda gradients: sent.append(gradients.numel()))
    reducer.zero_grad()
    reducer.start_when_ready()
    (first * 2).sum().backward()  # bucket 1 is complete, bucket 0 is not: nothing launches
    assert sent == [] and reducer.backward_launches == 0 and not reducer.issued
    (second * 3).sum().backward()  # bucket 0 completes: both launch, in bucket order
    assert sent == [3, 2] and reducer.backward_launches == 2 and reducer.issued
    reducer.start()  # nothing left to launch; every bucket seen once
    reducer.wait()
    assert sent == [3, 2]
    assert torch.equal(first.grad, torch.full((2,), 2.0))
    assert torch.equal(second.grad, torch.full((3,), 3.0))
