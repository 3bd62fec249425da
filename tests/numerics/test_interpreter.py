"""The interpreter on one rank with a fake transport: sent activations keep no data, received
gradients flow into the backward, reductions start at the schedule's points (with
--overlap-grad-reduce, during each module's last backward op)."""

import copy
from dataclasses import dataclass

import pytest
import torch

import pretrain_gpt
from megatron.core.config import ModelConfig, RecomputeConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.distributed import GradientReducer
from megatron.core.pipeline_parallel.execution.interpreter import (
    DEFAULT_OP_HANDLERS, ExecutionContext, Interpreter, OpHandler, _overlap_arming_points)
from megatron.core.pipeline_parallel.planning.lowering import (GradSyncStart, GradSyncWait,
                                                               lower_schedule)
from megatron.core.pipeline_parallel.execution.model_chunks import ModuleKey
from megatron.core.pipeline_parallel.planning.instructions import Instruction, Kind
from megatron.core.pipeline_parallel.planning.plan import make_plan
from megatron.core.pipeline_parallel.planning.schedules import build_schedule, schedule_layout

SEQ, BATCH, HIDDEN = 8, 2, 16


class RecordingTransport:
    """Stands in for the peers: records what is sent, answers receives with ones, and lets the
    test look at the interpreter's stored activations at every exchange."""

    def __init__(self):
        self.interpreter = None
        self.sent = []  # (message text, elements)
        self.sent_before = []  # per exchange: stored outputs (by micro-batch) sent earlier, size

    def start(self, sends, receives):
        """The Transport seam: post a group; the answer is ready at once."""
        # a message's text ends with its op in brackets, e.g. "... [>1:a0.0.1]"
        already_sent = {what.rstrip("]").rsplit(".", 1)[1] for what, _ in self.sent
                        if ":a" in what}
        self.sent_before.append({key[2]: output.numel() for key, (_, output, _)
                                 in self.interpreter.stored.items()
                                 if str(key[2]) in already_sent})
        self.sent.extend((item.what, item.tensor.numel()) for item in sends)
        return Completed([torch.ones(item.shape, dtype=item.dtype) for item in receives])


class Completed:
    """A posted exchange that has already completed."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait_received(self):
        return self.tensors

    def wait_sent(self):
        pass


class CountingReducer:
    def __init__(self):
        self.started = False

    def start(self):
        self.started = True


def _tiny_config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, seq_length=SEQ,
                       max_position_embeddings=SEQ, padded_vocab_size=32, hidden_dropout=0.0,
                       attention_dropout=0.0)


def _first_stage_of_1f1b_pp2(reducer, record_timeline: bool = False, zero_grad=None):
    """Stage 0 of 1F1B at PP 2 with two micro-batches, on a recording transport: (chunk,
    transport, interpreter, lowered plan)."""
    config = _tiny_config()
    chunk = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                     layer_range=range(0, 1), pre_process=True, post_process=False)
    layout = schedule_layout("1f1b", 2)
    lowered = lower_schedule(build_schedule("1f1b", 2, 2), layout)
    tokens = torch.randint(0, 32, (BATCH, SEQ))
    microbatches = [{"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(BATCH, SEQ),
                     "sample_ids": torch.arange(BATCH) + 2 * k} for k in range(2)]
    transport = RecordingTransport()
    interpreter = Interpreter(ExecutionContext(
        chunks={ModuleKey(0, 0): chunk}, layout=layout, transport=transport,
        forward_step_func=pretrain_gpt.forward_step, microbatches=microbatches, loss_divisor=2,
        activation_shape=(SEQ, BATCH, HIDDEN), wire_dtype=torch.float32,
        reducers={ModuleKey(0, 0): reducer}, record_timeline=record_timeline,
        zero_grad=zero_grad))
    transport.interpreter = interpreter
    return chunk, transport, interpreter, lowered


def test_first_stage_frees_sent_activations_and_backpropagates_received_gradients():
    reducer = CountingReducer()
    chunk, transport, interpreter, lowered = _first_stage_of_1f1b_pp2(reducer)
    assert interpreter.run(lowered, rank=0) == []  # stage 0 computes no loss

    # Both activations went out whole, and once sent the stored outputs hold one element only.
    assert [size for what, size in transport.sent if ":a" in what] == [SEQ * BATCH * HIDDEN] * 2
    assert any(transport.sent_before), "no exchange happened while a sent activation was stored"
    for stored in transport.sent_before:
        assert all(size == 1 for size in stored.values()), transport.sent_before
    assert interpreter.peak_stored == 2 and interpreter.peak_bytes > 0
    assert reducer.started
    # The received (all-ones) gradients reached the parameters of the chunk.
    assert chunk.embedding.word_embeddings.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("record", [False, True])
def test_message_records_pair_each_message_with_its_post_and_ready_times(record):
    """With the timeline, every activation sent and gradient consumed has a MessageRecord in
    time order (producing op end <= send post <= post returned; receive post <= asked <= ready);
    without it the interpreter keeps none (the instrumentation costs nothing)."""
    _, _, interpreter, lowered = _first_stage_of_1f1b_pp2(CountingReducer(), record)
    interpreter.run(lowered, rank=0)
    if not record:
        assert interpreter.messages == [] and interpreter.timeline == []
        return
    sends = {r.key: r for r in interpreter.messages if r.side == "send"}
    receives = {r.key: r for r in interpreter.messages if r.side == "receive"}
    assert sorted(sends) == [("activation", 0, 0, 0), ("activation", 0, 0, 1)]
    assert sorted(receives) == [("gradient", 0, 1, 0), ("gradient", 0, 1, 1)]
    forward_ends = [r.end + interpreter._origin for r in interpreter.timeline
                    if r.op.startswith("F")]
    for key, send in sends.items():
        assert send.produced == pytest.approx(forward_ends[key[3]], abs=1e-3)
        assert send.produced <= send.posted <= send.returned
    for receive in receives.values():
        assert receive.produced <= receive.posted <= receive.returned


@dataclass(frozen=True)
class OverlappedBackwardForward:
    """A new op kind: one backward and the next forward issued as one op (as DualPipe overlaps
    the backward of one direction with the forward of the other)."""

    backward: Instruction
    forward: Instruction

    def __str__(self) -> str:
        return f"{self.backward}+{self.forward}"


def _fuse_backward_forward_pairs(ops):
    """``ops`` with every backward instruction directly followed by a forward merged into one
    :class:`OverlappedBackwardForward`."""
    fused, index = [], 0
    while index < len(ops):
        op, following = ops[index], ops[index + 1] if index + 1 < len(ops) else None
        if (isinstance(op, Instruction) and op.kind is Kind.BACKWARD
                and isinstance(following, Instruction) and following.kind is Kind.FORWARD):
            fused.append(OverlappedBackwardForward(op, following))
            index += 2
        else:
            fused.append(op)
            index += 1
    return fused


def test_an_extra_handler_runs_a_new_op_kind_with_unchanged_numerics():
    """A fused backward+forward op kind is one handler passed to the interpreter; Chimera's
    first rank run with it gives the same losses and gradients, bit for bit, as the plain list."""
    config = _tiny_config()
    layout = schedule_layout("chimera", 2)
    assert layout.hosted(0) == ((0, 0), (1, 1))
    first = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                     layer_range=range(0, 1), pre_process=True, post_process=False)
    last = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                    layer_range=range(1, 2), pre_process=False, post_process=True)
    lowered = lower_schedule(build_schedule("chimera", 2, 4), layout)
    fused_lowered = [_fuse_backward_forward_pairs(ops) for ops in lowered]
    fused_count = sum(isinstance(op, OverlappedBackwardForward) for op in fused_lowered[0])
    assert fused_count >= 1, [str(op) for op in lowered[0]]
    tokens = torch.randint(0, 32, (4, BATCH, SEQ))
    microbatches = [{"tokens": tokens[k], "labels": tokens[k], "loss_mask": torch.ones(BATCH, SEQ),
                     "sample_ids": torch.arange(BATCH) + BATCH * k} for k in range(4)]
    calls = []

    def run_overlapped(interpreter, op):
        calls.append(str(op))
        DEFAULT_OP_HANDLERS[Kind.BACKWARD].run(interpreter, op.backward)
        DEFAULT_OP_HANDLERS[Kind.FORWARD].run(interpreter, op.forward)

    def run(ops_by_rank, extra_handlers=None):
        chunks = {ModuleKey(0, 0): copy.deepcopy(first), ModuleKey(1, 1): copy.deepcopy(last)}
        transport = RecordingTransport()
        interpreter = Interpreter(ExecutionContext(
            chunks=chunks, layout=layout, transport=transport,
            forward_step_func=pretrain_gpt.forward_step, microbatches=microbatches, loss_divisor=4,
            activation_shape=(SEQ, BATCH, HIDDEN), wire_dtype=torch.float32,
            reducers={key: CountingReducer() for key in chunks}, record_timeline=True),
            extra_handlers=extra_handlers)
        transport.interpreter = interpreter
        losses = interpreter.run(ops_by_rank, rank=0)
        grads = {(key, name): parameter.grad.clone() for key, chunk in chunks.items()
                 for name, parameter in chunk.named_parameters() if parameter.grad is not None}
        return losses, grads, interpreter.timeline, transport.sent

    plain_losses, plain_grads, _, plain_sent = run(lowered)
    losses, grads, timeline, sent = run(fused_lowered, {OverlappedBackwardForward: OpHandler(
        run_overlapped, "backward-compute", computes=True)})

    assert len(calls) == fused_count and calls[0] in {record.op for record in timeline}
    assert len(losses) == len(plain_losses) == 2  # the up pipeline's last stage: 2 micro-batches
    for loss_dict, plain in zip(losses, plain_losses):
        assert all(torch.equal(loss_dict[key], plain[key]) for key in plain)
    assert sent == plain_sent
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for key, grad in grads.items():
        assert torch.equal(grad, plain_grads[key]), key
    for module in (ModuleKey(0, 0), ModuleKey(1, 1)):
        assert any(grad.abs().sum() > 0 for (key, _), grad in grads.items() if key == module)


def test_a_handler_with_an_unknown_timer_or_lane_is_refused():
    with pytest.raises(ValueError, match="timer 'fused-compute'.*forward-compute"):
        OpHandler(lambda interpreter, op: None, "fused-compute")
    with pytest.raises(ValueError, match="lane 'gpu'"):
        OpHandler(lambda interpreter, op: None, "forward-compute", lane="gpu")


def test_an_op_without_a_handler_is_named_in_the_error():
    config = _tiny_config()
    layout = schedule_layout("1f1b", 1)
    chunk = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                     layer_range=range(0, 2), pre_process=True, post_process=True)
    lowered = [_fuse_backward_forward_pairs(ops)
               for ops in lower_schedule(build_schedule("1f1b", 1, 2), layout)]
    tokens = torch.randint(0, 32, (BATCH, SEQ))
    interpreter = Interpreter(ExecutionContext(
        chunks={ModuleKey(0, 0): chunk}, layout=layout, transport=None,
        forward_step_func=pretrain_gpt.forward_step, loss_divisor=2, wire_dtype=torch.float32,
        microbatches=[{"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(BATCH, SEQ)}] * 2))
    with pytest.raises(TypeError, match="no handler for the lowered op.*OverlappedBackwardForward"
                                        ".*extra_handlers"):
        interpreter.run(lowered, rank=0)


def test_zero_grad_runs_once_at_the_first_wait_and_the_gradients_are_a_fresh_runs():
    # Stage 0 of 1F1B at PP 2 runs F0 F1, then waits for the gradient of micro-batch 0: the
    # zeroing belongs there (the pipeline's fill), after both forwards and before any backward.
    torch.manual_seed(0)  # the same micro-batches for both runs
    reference_chunk, _, reference, lowered = _first_stage_of_1f1b_pp2(CountingReducer())
    reference.run(lowered, rank=0)
    expected = {name: p.grad.clone() for name, p in reference_chunk.named_parameters()}

    calls, running = [], []

    def zero_grad():
        interpreter = running[0]
        calls.append((len(interpreter.stored), sorted(interpreter.received)))
        for param in chunk.parameters():
            param.grad.zero_()

    torch.manual_seed(0)
    chunk, _, interpreter, lowered = _first_stage_of_1f1b_pp2(CountingReducer(),
                                                              zero_grad=zero_grad)
    running.append(interpreter)
    chunk.load_state_dict(reference_chunk.state_dict())
    for param in chunk.parameters():  # stale gradients of an earlier iteration
        param.grad = torch.full_like(param, 3.0)
    interpreter.run(lowered, rank=0)
    assert len(calls) == 1
    stored, received = calls[0]
    assert stored == 2  # both forwards ran before it
    assert received and all(str(key[0]).lower().startswith("g")
                            for key in received)  # it ran before taking a gradient
    for name, param in chunk.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0)


def test_zero_grad_runs_before_the_first_backward_without_any_message():
    # One rank, no pipeline messages: the zeroing runs before the first backward op.
    config = _tiny_config()
    chunk = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234)
    layout = schedule_layout("1f1b", 1)
    lowered = lower_schedule(build_schedule("1f1b", 1, 2), layout)
    tokens = torch.randint(0, 32, (BATCH, SEQ))
    microbatches = [{"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(BATCH, SEQ),
                     "sample_ids": torch.arange(BATCH) + 2 * k} for k in range(2)]
    for param in chunk.parameters():
        param.grad = torch.full_like(param, 3.0)
    calls = []
    interpreter = Interpreter(ExecutionContext(
        chunks={ModuleKey(0, 0): chunk}, layout=layout, transport=None,
        forward_step_func=pretrain_gpt.forward_step, microbatches=microbatches, loss_divisor=2,
        wire_dtype=torch.float32, reducers={ModuleKey(0, 0): CountingReducer()},
        zero_grad=lambda: calls.append([p.grad.abs().max().item() for p in chunk.parameters()])
        or [p.grad.zero_() for p in chunk.parameters()]))
    interpreter.run(lowered, rank=0)
    assert len(calls) == 1 and all(value == 3.0 for value in calls[0])  # before any backward
    assert all(p.grad.abs().max() < 3.0 for p in chunk.parameters())  # stale 3s are gone


class RecordingReducer(GradientReducer):
    """A one-rank GradientReducer (no group: only the division) that logs the interpreter-facing
    events of an iteration into ``events``: "arm", "launch" (one bucket), "start"."""

    def __init__(self, params, events: list, overlap: bool):
        super().__init__(params, None, divide_by=2, bucket_size=300, overlap=overlap)
        self.events = events

    def start_when_ready(self):
        self.events.append("arm")
        super().start_when_ready()

    def _launch(self, bucket):
        self.events.append("launch")
        super()._launch(bucket)

    def start(self):
        self.events.append("start")
        super().start()


def _logged(kind, events):
    """The built-in handler of ``kind`` that also logs the op's kind after it ran."""
    default = DEFAULT_OP_HANDLERS[kind]
    return OpHandler(lambda interpreter, op: (default.run(interpreter, op),
                                              events.append(kind.name)),
                     default.timer, computes=True)


def _one_stage_iteration(stage: int, split: bool, overlap: bool):
    """Stage ``stage`` of 1F1B at PP 2 with four micro-batches (the other stage's messages are
    ones), with a RecordingReducer: (gradients after the reduction, events, backward launches,
    number of buckets, the kind of the rank's last backward-type op)."""
    torch.manual_seed(0)
    config = _tiny_config()
    chunk = GPTModel(config, RecomputeConfig(), ParallelState.single_process(), 1234,
                     layer_range=range(stage, stage + 1), pre_process=stage == 0,
                     post_process=stage == 1)
    plan = make_plan("1f1b", 2, 4, split_backward=0 if split else None)
    tokens = torch.randint(0, 32, (4, BATCH, SEQ))
    microbatches = [{"tokens": tokens[k], "labels": tokens[k],
                     "loss_mask": torch.ones(BATCH, SEQ),
                     "sample_ids": torch.arange(BATCH) + 2 * k} for k in range(4)]
    events: list = []
    reducer = RecordingReducer(chunk.parameters(), events, overlap)
    assert len(reducer.buckets) > 2
    transport = RecordingTransport()
    logged = {kind: _logged(kind, events) for kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT,
                                                       Kind.BACKWARD_WEIGHT)}
    interpreter = Interpreter(ExecutionContext(
        chunks={ModuleKey(0, stage): chunk}, layout=plan.layout, transport=transport,
        forward_step_func=pretrain_gpt.forward_step, microbatches=microbatches, loss_divisor=4,
        activation_shape=(SEQ, BATCH, HIDDEN), wire_dtype=torch.float32,
        reducers={ModuleKey(0, stage): reducer}, overlap_grad_reduce=overlap,
        zero_grad=reducer.zero_grad), extra_handlers=logged)
    transport.interpreter = interpreter
    interpreter.run(plan.lowered, rank=stage)
    reducer.wait()
    grads = {name: p.grad.clone() for name, p in chunk.named_parameters()}
    last_backward = [op.kind.name for op in plan.lowered[stage]
                     if isinstance(op, Instruction) and op.kind is not Kind.FORWARD][-1]
    return grads, events, reducer.backward_launches, len(reducer.buckets), last_backward


@pytest.mark.parametrize("split", [False, True], ids=["full-backward", "split-backward"])
@pytest.mark.parametrize("stage", [0, 1], ids=["first-stage", "last-stage"])
def test_overlap_launches_every_bucket_during_the_modules_last_backward_op(stage, split):
    """--overlap-grad-reduce: the reducer is armed right before the module's last backward-type
    op (its last weight half under split backward, whose engine accumulation fires the hooks),
    every bucket launches during that op, before GradSyncStart; the gradients are bit-identical."""
    grads, events, launches, buckets, last_op = _one_stage_iteration(stage, split, overlap=True)
    reference, plain_events, plain_launches, _, _ = _one_stage_iteration(stage, split,
                                                                         overlap=False)
    # The split plan keeps stage 0's backwards whole (no idle slot to move a weight half to)
    # and ends stage 1 with a weight half.
    assert last_op == ("BACKWARD_WEIGHT" if split and stage == 1 else "BACKWARD")
    arm = events.index("arm")
    assert events.count("arm") == 1 and "launch" not in events[:arm]
    assert events[arm + 1:] == ["launch"] * buckets + [last_op, "start"], events
    assert launches == buckets
    assert plain_launches == 0 and plain_events[-buckets - 1:] == ["start"] + ["launch"] * buckets
    assert "arm" not in plain_events
    for name, value in reference.items():
        torch.testing.assert_close(grads[name], value, rtol=0, atol=0, msg=name)


def test_an_unknown_op_kind_in_the_list_arms_no_overlap():
    """A fused op the interpreter cannot see inside may hold a module's last backward: arming
    before an earlier backward would launch buckets too early, so nothing is armed."""
    ops = [Instruction(Kind.FORWARD, 0, 0, 0), Instruction(Kind.BACKWARD, 0, 0, 0),
           OverlappedBackwardForward(Instruction(Kind.BACKWARD, 0, 0, 1),
                                     Instruction(Kind.FORWARD, 0, 0, 2))]
    assert _overlap_arming_points(ops, {ModuleKey(0, 0): object()}) == {}
    assert list(_overlap_arming_points(ops[:2], {ModuleKey(0, 0): object()})) == [1]


class ArmingReducer:
    """Records whether it was armed; ``issued`` as the test sets it."""

    def __init__(self, issued: bool = False):
        self.issued = issued
        self.armed = False

    def start_when_ready(self):
        self.armed = True


def test_a_module_is_armed_only_once_the_modules_before_it_in_the_sync_order_issued():
    """Collectives of different groups keep the schedule's one sync order on every rank: a
    module whose last backward comes first but whose sync comes second waits for the first."""
    late, early = ArmingReducer(), ArmingReducer()
    reducers = {ModuleKey(0, 1): late, ModuleKey(0, 0): early}
    backwards = [Instruction(Kind.BACKWARD, 0, 1, 0), Instruction(Kind.BACKWARD, 0, 0, 0)]
    late_first = backwards + [GradSyncStart(0, 1), GradSyncStart(0, 0), GradSyncWait()]
    assert _overlap_arming_points(late_first, reducers) == {0: (late, ()), 1: (early, (late,))}
    early_first = backwards + [GradSyncStart(0, 0), GradSyncStart(0, 1), GradSyncWait()]
    assert _overlap_arming_points(early_first, reducers) == {0: (late, (early,)), 1: (early, ())}

    interpreter = Interpreter(ExecutionContext(
        chunks={}, layout=None, transport=None, forward_step_func=None, microbatches=[],
        loss_divisor=1, wire_dtype=torch.float32))
    interpreter._arm_overlap(late, (early,))  # early has not issued its reduction yet
    assert not late.armed
    early.issued = True
    interpreter._arm_overlap(late, (early,))
    assert late.armed
