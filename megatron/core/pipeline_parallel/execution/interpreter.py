"""The interpreter: executes one rank's lowered instruction list, whatever the schedule.

The lowered list (:mod:`megatron.core.pipeline_parallel.planning.lowering`) holds four kinds of op:
compute :class:`Instruction` (forward / backward of one micro-batch through one of the rank's model
chunks), :class:`P2PGroup` (one batched exchange with pipeline peers), :class:`GradSyncStart` (launch
a module's gradient reduction) and :class:`GradSyncWait` (the end of the list). There is no
schedule-specific branch here: GPipe, 1F1B, interleaved 1F1B and every Chimera variant run through
the same loop. Each op is run by the :class:`OpHandler` its kind maps to (:data:`DEFAULT_OP_HANDLERS`,
keyed by :func:`op_kind`); a new op kind, such as DualPipe's overlapped forward of one direction and
backward of the other, is one more handler passed as ``Interpreter(context, extra_handlers=...)``.

Communication is asynchronous (the simulator's ``p2p_semantics="async"``): the receives of the
groups that follow a compute op are posted before that op runs (prefetch), a received tensor is
waited for only when the op that consumes it starts, and sends are posted when the list reaches
their group (before the group's receives that could not be prefetched) and complete in the
background; the rank waits for them at the end of the iteration. What each op needs from the plan
(its handler, prefetch groups, each group's keys, peers and message descriptions) is resolved before
the first op, and groups once per plan: after an op's sleep the first Python and tensor work runs
several times slower than warm on a busy host (docs/benchmarks.md §9, "Per-op overhead, cut").
No wait depends on anything but the schedule's compute dependencies, so every schedule the
simulator finds deadlock-free runs.

State lives in dictionaries keyed by (pipeline, stage, micro-batch): received tensors (or their
posted receives) waiting for their consumer, stored activations waiting for their backward, and
produced tensors waiting for their send. Everything is released as soon as it is consumed; an activation that has been sent keeps
no data (only its autograd graph, which the backward needs). Stored-activation bytes (what autograd
saves for the backward, parameters excluded) are counted per micro-batch, and their peak is kept;
the counting hook runs on the first forward of each module and micro-batch shape only.

With ``--overlap-grad-reduce`` (``ExecutionContext.overlap_grad_reduce``) each module's reducer is
armed right before that module's last backward-type op of the list, so its buckets launch from the
parameters' post-accumulate-grad hooks while that op runs (Megatron-LM's overlap with a pipeline:
during the last micro-batch's backward of each model chunk); the module's GradSyncStart then
launches whatever is left. Reducers that do not overlap ignore the arming.

Any exception is re-raised with the rank's op list printed as a grid, the failing step marked.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron.core.distributed.reducers import GradientReduction

from ..planning.dependencies import ACTIVATION, GRADIENT
from ..planning.grid import format_op_grid
from ..planning.instructions import Instruction, Kind
from ..planning.lowering import RECV, SEND, GradSyncStart, GradSyncWait, P2PGroup
from ..planning.schedules import ScheduleLayout
from .instruction_timing import INSTRUCTION_TIMERS, InstructionSeconds
from .model_chunks import ModuleKey
from .split_backward import (TrainableParameters, backward_input, backward_weight,
                             input_half_boundary)
from .stage import PipelineStageModule
from .transport import ExpectedTensor, OutgoingTensor, Transport


class PipelineExecutionError(RuntimeError):
    """An op failed; the message shows this rank's list with the failing step marked."""


def backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward through ``output`` with gradient ``grad``, even if ``output``'s data was freed.

    ``torch.autograd.backward`` checks the gradient's shape against the tensor's (now empty) data,
    so call the engine directly, as Megatron-LM does for the same reason; the graph keeps the
    recorded shape.
    """
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


def free_tensor_data(tensor: torch.Tensor) -> None:
    """Drop the storage of an already-sent activation; its autograd graph stays."""
    tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)


class _SavedActivationCounter:
    """Counts the bytes autograd saves during a forward (parameters excluded)."""

    def __init__(self, parameter_pointers: set):
        self.parameter_pointers = parameter_pointers
        self.nbytes = 0
        self._seen = set()

    def pack(self, tensor: torch.Tensor):
        if tensor.layout == torch.strided and tensor.data_ptr() not in self.parameter_pointers:
            key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
            if key not in self._seen:
                self._seen.add(key)
                self.nbytes += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@dataclass
class TimelineRecord:
    """One executed op with measured times (seconds since the iteration started); ``lane`` is
    "compute" or "communication" (posting messages, waiting for them)."""

    op: str
    start: float
    end: float
    lane: str = "compute"


@dataclass(frozen=True)
class MessageRecord:
    """One pipeline message as one rank saw it (recorded with the timeline only), in absolute
    ``time.perf_counter()`` seconds: CLOCK_MONOTONIC on Linux, one clock for every process of a
    host, so a sender's and a receiver's records compare. ``key`` is (kind, pipeline, stage,
    micro-batch) of the message, unique in an iteration.

    ``side == "send"`` (the producer): ``produced`` is when the op that produced the tensor ended
    (None if no compute op of this list produced it), ``posted`` when its send was posted and
    ``returned`` when posting returned. ``side == "receive"`` (the consumer): ``produced`` is when
    its receive was posted, ``posted`` when the consuming op asked for the tensor and
    ``returned`` when it had it (equal when the message had already arrived)."""

    key: tuple
    side: str
    produced: Optional[float]
    posted: float
    returned: float


class _PostedReceives:
    """The receives of one group, posted together; completed on first use."""

    def __init__(self, pending):
        self.pending = pending
        self.tensors = None

    def tensor(self, index: int) -> torch.Tensor:
        if self.tensors is None:
            self.tensors = self.pending.wait_received()
        return self.tensors[index]


@dataclass
class ExecutionContext:
    """Everything one iteration of one rank needs besides its op list.

    ``microbatches[k]`` is instruction micro-batch k (see ``ScheduleLayout.microbatch_samples``);
    ``loss_divisor`` is the number of instruction micro-batches of this data-parallel rank, so the
    summed gradients are those of the mean loss. Received activations have the shape the consuming
    chunk declares (stage contract), unless ``activation_shape`` fixes one for every message;
    received gradients have the shape of the activation they belong to.
    """

    chunks: Mapping[ModuleKey, PipelineStageModule]
    layout: ScheduleLayout  # which stages read data / compute the loss
    transport: Optional[Transport]
    forward_step_func: Callable
    microbatches: Sequence[dict]
    loss_divisor: int
    wire_dtype: torch.dtype
    activation_shape: Optional[tuple] = None
    scale_loss: Callable = lambda loss: loss
    reducers: Mapping[ModuleKey, GradientReduction] = field(default_factory=dict)
    final_reducers: Sequence[GradientReduction] = ()  # started at GradSyncWait (tied embedding)
    # (pipeline, stage, micro-batch shapes) -> bytes autograd saves in one forward; kept by the
    # runtime across iterations so the counting hook runs once per module and shape.
    saved_bytes_cache: dict = field(default_factory=dict)
    forward_only: bool = False
    autocast: Callable = contextlib.nullcontext
    record_timeline: bool = False
    instruction_seconds: Optional[InstructionSeconds] = None  # --timing-log-level 2
    # id(P2PGroup) -> (group, _GroupPlan): what each group of the lowered lists sends and receives,
    # resolved once (kept by the runtime across iterations, like saved_bytes_cache).
    group_plans: dict = field(default_factory=dict)
    # Zeroes the gradients (the caller's optimizer.zero_grad) once, late: before this rank's first
    # wait for a pipeline message or its first backward op, whichever comes first. Every gradient
    # is accumulated after it; at the start of the list it would delay the first op, while the
    # first wait falls in the pipeline's fill, where the rank is idle in the plan.
    zero_grad: Optional[Callable[[], None]] = None
    # --overlap-grad-reduce: arm each module's reducer (``start_when_ready()``) right before that
    # module's last backward-type op of the list, so its buckets launch during that op (see
    # _overlap_arming_points); GradSyncStart launches what is left.
    overlap_grad_reduce: bool = False


def describe_message(p2p) -> str:
    """A pipeline message in words, for errors: ``the activation of micro-batch 3 (pipeline 0,
    stage 1) [<1:a0.1.3]`` (the bracket is the op as the schedule grid prints it)."""
    message = p2p.message
    return (f"the {message.kind} of micro-batch {message.microbatch} (pipeline "
            f"{message.pipeline}, stage {message.stage}) [{p2p}]")


@dataclass(frozen=True)
class _GroupPlan:
    """One P2P group's messages, resolved once from the lowered op: ``sends`` are (key, peer,
    activation?, description), ``receives`` (key, peer, message, description); ``gradient_keys``
    are the (pipeline, stage, micro-batch) of the activations whose gradients it receives (a
    prefetch needs their shapes)."""

    sends: tuple
    receives: tuple
    gradient_keys: tuple


def _plan_group(group: P2PGroup) -> _GroupPlan:
    sends, receives, gradient_keys = [], [], []
    for p2p in group.ops:
        message = p2p.message
        key = (message.kind, message.pipeline, message.stage, message.microbatch)
        if p2p.direction == SEND:
            sends.append((key, p2p.peer, message.kind == ACTIVATION, describe_message(p2p)))
        elif p2p.direction == RECV:
            receives.append((key, p2p.peer, message, describe_message(p2p)))
            if message.kind == GRADIENT:
                gradient_keys.append(Interpreter._producing_key(message))
    return _GroupPlan(tuple(sends), tuple(receives), tuple(gradient_keys))


@dataclass(frozen=True)
class OpHandler:
    """How the interpreter runs one kind of lowered op.

    ``run(interpreter, op)`` executes the op against the interpreter's state (its received,
    stored and produced tensors); ``timer`` is the per-instruction timer the op's interval counts
    towards (one of :data:`.instruction_timing.INSTRUCTION_TIMERS`); ``lane`` is its timeline lane
    ("compute" or "communication"); ``computes`` marks a compute op, before which the receives of
    the P2P groups that follow it are posted (prefetch).
    """

    run: Callable[["Interpreter", Any], None]
    timer: str
    lane: str = "compute"
    computes: bool = False

    def __post_init__(self) -> None:
        if self.timer not in INSTRUCTION_TIMERS:
            raise ValueError(f"OpHandler timer {self.timer!r} is not a per-instruction timer; use "
                             f"one of {INSTRUCTION_TIMERS} (or add it in instruction_timing.py)")
        if self.lane not in ("compute", "communication"):
            raise ValueError(f"OpHandler lane {self.lane!r} must be 'compute' or 'communication'")


def op_kind(op) -> object:
    """The handler-table key of a lowered op: a compute :class:`Instruction`'s :class:`Kind`,
    otherwise the op's type (:class:`P2PGroup`, :class:`GradSyncStart`, :class:`GradSyncWait` or
    a new op class with its own handler)."""
    return op.kind if isinstance(op, Instruction) else type(op)


class Interpreter:
    """Runs one rank's lowered ops for one iteration (see the module docstring)."""

    def __init__(self, context: ExecutionContext,
                 extra_handlers: Optional[Mapping[object, OpHandler]] = None):
        """``extra_handlers`` (op kind -> :class:`OpHandler`, see :func:`op_kind`) add op kinds to
        :data:`DEFAULT_OP_HANDLERS` or replace built-in ones, for this interpreter only."""
        self.context = context
        self.handlers: Mapping[object, OpHandler] = {**DEFAULT_OP_HANDLERS,
                                                       **(extra_handlers or {})}
        self.received: dict = {}  # message key -> (_PostedReceives, index in it)
        self.pending_sends: list = []  # posted sends, completed at the end of the iteration
        self.prefetched: set = set()  # ids of groups whose receives are already posted
        self.produced: dict = {}  # (kind, pipeline, stage, microbatch) -> tensor to send
        self.stored: dict = {}  # (pipeline, stage, microbatch) -> (input, output, nbytes)
        self.output_shapes: dict = {}  # (pipeline, stage, microbatch) -> shape of its gradient
        self.deferred: dict = {}  # (pipeline, stage, microbatch) -> weight work of a split backward
        self.loss_dicts: list = []
        self.timeline: list[TimelineRecord] = []
        self.messages: list[MessageRecord] = []  # with the timeline only
        # timeline only: message key -> end of its producing op (sends) or receive post (receives)
        self._produced_at: dict = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_stored = 0
        # Fixed for the iteration, so read once (every op would read them again otherwise; the
        # first Python after a sleep runs several times slower than warm, docs/benchmarks.md §9).
        self._measuring = context.record_timeline or context.instruction_seconds is not None
        self._chunk_cache: dict = {}  # (pipeline, stage) -> (chunk, is first stage, is last stage)
        self._trainable_cache: dict = {}  # (pipeline, stage) -> TrainableParameters
        self._signatures: dict = {}  # micro-batch index -> _shape_signature of its tensors
        self._op_start = 0.0
        # None once called (see ExecutionContext.zero_grad)
        self._zero_grad: Optional[Callable[[], None]] = context.zero_grad
        self._parameter_pointers = {p.data_ptr() for chunk in context.chunks.values()
                                    for p in _parameters(chunk)}

    def run(self, lowered: Sequence[Sequence], rank: int) -> list[dict]:
        """Execute ``lowered[rank]`` (``lowered`` holds every rank's list, for error reports);
        return the loss dicts of the micro-batches whose loss this rank computed.

        With ``context.forward_only`` the lists must be :func:`forward_only_ops` of the schedule.
        """
        ops = lowered[rank]
        self._origin = self._now()
        handlers = [self._handler(op) for op in ops]
        prefetch = _prefetch_plan(ops, handlers)
        measuring, last = self._measuring, len(ops) - 1
        arming = (_overlap_arming_points(ops, self.context.reducers)
                  if self.context.overlap_grad_reduce and not self.context.forward_only else {})
        # Everything an op needs from the plan is resolved here, before the first op runs.
        steps = [(op, handler.run, prefetch.get(index, ()), arming.get(index))
                 for index, (op, handler) in enumerate(zip(ops, handlers))]
        for index, (op, run_op, prefetch_groups, armed_reducer) in enumerate(steps):
            try:
                for group in prefetch_groups:
                    self._post_receives(group, prefetch=True)
                if armed_reducer is not None:
                    self._arm_overlap(*armed_reducer)
                # A compute op's record starts once its inputs are in (see _take_received).
                if measuring:
                    self._op_start = self._now()
                run_op(self, op)
                if index == last:
                    self._complete_sends()
            except Exception as error:
                raise PipelineExecutionError(
                    f"pipeline rank failed at step {index} ({op}): {type(error).__name__}: "
                    f"{error}\n" + format_op_grid(
                        [[str(o) for o in rank_ops] for rank_ops in lowered], {(rank, index)},
                        title=f"lowered schedule (rank x step), failing step of rank {rank} "
                              f"marked")) from error
            if measuring:
                self._record(op, self._op_start, handlers[index].lane, handlers[index].timer)
                if self.context.record_timeline and handlers[index].computes:
                    self._note_produced(op)
        if self._zero_grad is not None:  # a list without a backward or a message
            self._zero_grads_now()
        leftovers = [key for key in (*self.received, *self.produced, *self.stored,
                                     *self.deferred)]
        if leftovers:
            raise PipelineExecutionError(f"the schedule left unconsumed tensors {leftovers[:8]}; "
                                         f"the lowered list is inconsistent")
        return self.loss_dicts

    def _now(self) -> float:
        clock = self.context.instruction_seconds
        return clock.now() if clock is not None else time.perf_counter()

    def _record(self, what, start: float, lane: str, timer: str) -> None:
        """Account the interval from ``start`` to now: as a timeline record named ``str(what)``
        (with --pipeline-timeline) and towards ``timer`` (with --timing-log-level 2)."""
        if not self._measuring:
            return
        end = self._now()
        if self.context.record_timeline:
            self.timeline.append(TimelineRecord(str(what), start - self._origin,
                                                end - self._origin, lane))
        if self.context.instruction_seconds is not None:
            self.context.instruction_seconds.add(timer, end - start)

    def _note_produced(self, op) -> None:
        """Timeline only: when the message ``op`` produces (if any) became ready to send."""
        if not isinstance(op, Instruction):
            return
        kind = {Kind.FORWARD: ACTIVATION, Kind.BACKWARD: GRADIENT,
                Kind.BACKWARD_INPUT: GRADIENT}.get(op.kind)
        if kind is not None:
            self._produced_at[(kind, op.pipeline, op.stage, op.microbatch)] = self._now()

    def _handler(self, op) -> OpHandler:
        handler = self.handlers.get(op_kind(op))
        if handler is None:
            raise TypeError(f"no handler for the lowered op {op!r} (kind {op_kind(op)!r}); "
                            f"known kinds: {list(self.handlers)}; pass one to Interpreter(..., "
                            f"extra_handlers={{kind: OpHandler(...)}})")
        return handler

    def _arm_overlap(self, reducer: GradientReduction,
                     earlier: Sequence[GradientReduction]) -> None:
        """--overlap-grad-reduce: arm ``reducer`` before its module's last backward op, unless a
        reduction ``earlier`` in the rank's sync order has not issued all its collectives yet
        (then the module's GradSyncStart launches it, as without overlap: the collectives of
        different groups keep the schedule's one order on every rank). The gradients are zeroed
        first if nothing did yet (the op would do it before accumulating)."""
        if self._zero_grad is not None:
            self._zero_grads_now()
        if all(other.issued for other in earlier):
            reducer.start_when_ready()

    def _start_grad_sync(self, op: GradSyncStart) -> None:
        self.context.reducers[ModuleKey(op.pipeline, op.stage)].start()

    def _start_remaining_syncs(self, op: Optional[GradSyncWait] = None) -> None:
        """Start every reduction the list did not start, then the final ones (tied embedding).

        A module can have no micro-batch at all (Chimera with N < D leaves a pipeline empty); its
        replicas elsewhere still reduce, so it joins with its (zero) gradient. Late stages first,
        like the lowering's end-of-list order.
        """
        pending = [(key, reducer) for key, reducer in self.context.reducers.items()
                   if not reducer.started]
        for _, reducer in sorted(pending, key=lambda item: -item[0].stage):
            reducer.start()
        for reducer in self.context.final_reducers:
            reducer.start()

    def _chunk(self, pipeline: int, stage: int) -> tuple:
        """(chunk, is first stage, is last stage) of module (pipeline, stage), looked up once."""
        entry = self._chunk_cache.get((pipeline, stage))
        if entry is None:
            layout = self.context.layout
            entry = self._chunk_cache[(pipeline, stage)] = (
                self.context.chunks[ModuleKey(pipeline, stage)], layout.is_first_stage(stage),
                layout.is_last_stage(stage))
        return entry

    def _trainable(self, pipeline: int, stage: int) -> TrainableParameters:
        """The trainable parameters of module (pipeline, stage) and their gradient accumulators,
        resolved once per iteration (what every input half of a split backward needs)."""
        entry = self._trainable_cache.get((pipeline, stage))
        if entry is None:
            chunk = self._chunk(pipeline, stage)[0]
            entry = self._trainable_cache[(pipeline, stage)] = TrainableParameters.of(
                _parameters(chunk))
        return entry

    def _forward_and_loss(self, context, microbatch, chunk, is_last: bool):
        """The chunk's forward (under autocast); on the last stage the scaled loss it returns,
        with the loss dict kept for logging."""
        with context.autocast():
            output, loss_func = context.forward_step_func(microbatch, chunk)
        if is_last:
            loss, loss_dict = loss_func(output)
            self.loss_dicts.append(loss_dict)
            output = context.scale_loss(loss / context.loss_divisor)
        return output

    def _forward(self, op: Instruction) -> None:
        context = self.context
        chunk, is_first, is_last = self._chunk(op.pipeline, op.stage)
        input_tensor = None
        if not is_first:
            input_tensor = self._take_received((ACTIVATION, op.pipeline, op.stage - 1,
                                                op.microbatch))
            if not context.forward_only:
                input_tensor.requires_grad_(True)
        # What autograd saves depends only on the module and the input shapes: it is counted
        # (with a per-tensor Python hook) once per module and micro-batch shape, then reused.
        microbatch = context.microbatches[op.microbatch]
        signature = self._signatures.get(op.microbatch)
        if signature is None:
            signature = self._signatures[op.microbatch] = _shape_signature(microbatch)
        bytes_key = (op.pipeline, op.stage, signature)
        counter = None
        if not context.forward_only and bytes_key not in context.saved_bytes_cache:
            counter = _SavedActivationCounter(self._parameter_pointers)
        chunk.set_input_tensor(input_tensor)
        if counter is None and not context.forward_only:  # every forward after the first
            output = self._forward_and_loss(context, microbatch, chunk, is_last)
        else:
            grad_mode = torch.no_grad() if context.forward_only else contextlib.nullcontext()
            hooks = counter.hooks() if counter is not None else contextlib.nullcontext()
            with grad_mode, hooks:
                output = self._forward_and_loss(context, microbatch, chunk, is_last)
        chunk.set_input_tensor(None)
        if not is_last:
            self.produced[(ACTIVATION, op.pipeline, op.stage, op.microbatch)] = output
            if not context.forward_only:
                self.output_shapes[(op.pipeline, op.stage, op.microbatch)] = tuple(output.shape)
        if not context.forward_only:
            if counter is not None:
                context.saved_bytes_cache[bytes_key] = counter.nbytes
            nbytes = context.saved_bytes_cache[bytes_key]
            self.stored[(op.pipeline, op.stage, op.microbatch)] = (input_tensor, output, nbytes)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_stored = max(self.peak_stored, len(self.stored))

    def _backward(self, op: Instruction) -> None:
        if self._zero_grad is not None:
            self._zero_grads_now()
        input_tensor, output, nbytes = self.stored.pop((op.pipeline, op.stage, op.microbatch))
        grad = self._output_gradient(op, output)
        if grad is None:
            output.backward()
        else:
            backward_from(output, grad)
        self.live_bytes -= nbytes
        if not self._chunk(op.pipeline, op.stage)[1]:
            self.produced[(GRADIENT, op.pipeline, op.stage, op.microbatch)] = input_tensor.grad

    def _output_gradient(self, op: Instruction, output: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient arriving for ``output`` (None on a last stage: the output is the loss)."""
        if self._chunk(op.pipeline, op.stage)[2]:
            return None
        grad = self._take_received((GRADIENT, op.pipeline, op.stage + 1, op.microbatch))
        return grad if grad.dtype == output.dtype else grad.to(output.dtype)

    def _backward_input(self, op: Instruction) -> None:
        """Input half of a split backward: the gradient message now, the weight work kept."""
        if self._zero_grad is not None:
            self._zero_grads_now()
        key = (op.pipeline, op.stage, op.microbatch)
        input_tensor, output, _ = self.stored[key]
        is_first = self._chunk(op.pipeline, op.stage)[1]
        trainable = self._trainable(op.pipeline, op.stage)
        # The graph walk needs no message: done before waiting for the gradient, it overlaps
        # the wait when the gradient is still in flight.
        boundary = input_half_boundary(output, input_tensor, trainable)
        input_grad, self.deferred[key] = backward_input(
            output, self._output_gradient(op, output), input_tensor, trainable, boundary)
        if not is_first:
            self.produced[(GRADIENT, op.pipeline, op.stage, op.microbatch)] = input_grad

    def _backward_weight(self, op: Instruction) -> None:
        """Weight half of a split backward; the stage's stored activations are released."""
        if self._zero_grad is not None:
            self._zero_grads_now()
        key = (op.pipeline, op.stage, op.microbatch)
        backward_weight(self.deferred.pop(key))
        _, _, nbytes = self.stored.pop(key)
        self.live_bytes -= nbytes

    def _group_plan(self, group: P2PGroup) -> _GroupPlan:
        entry = self.context.group_plans.get(id(group))
        if entry is None or entry[0] is not group:
            entry = self.context.group_plans[id(group)] = (group, _plan_group(group))
        return entry[1]

    def _communicate(self, group: P2PGroup) -> None:
        """Post the group's sends, then its receives unless prefetched (a peer may be waiting for
        what this rank just computed; the receives are for later ops); wait for nothing."""
        context = self.context
        plan = self._group_plan(group)
        if plan.sends:
            sends, sent_outputs = [], []
            for key, peer, is_activation, what in plan.sends:
                tensor = self.produced.pop(key)
                if is_activation and not context.forward_only:
                    sent_outputs.append(tensor)
                wire = tensor.detach()
                if wire.dtype != context.wire_dtype:
                    wire = wire.to(context.wire_dtype)
                if not wire.is_contiguous():
                    wire = wire.contiguous()
                sends.append(OutgoingTensor(peer, wire, what))
            posted = self._now() if context.record_timeline else 0.0
            self.pending_sends.append(self._transport().start(sends, []))
            if context.record_timeline:
                returned = self._now()
                self.messages.extend(MessageRecord(key, "send", self._produced_at.pop(key, None),
                                                   posted, returned) for key, *_ in plan.sends)
            for output in sent_outputs:
                # The send buffer keeps the storage alive until the send completes.
                free_tensor_data(output)
        self._post_receives(group)

    def _post_receives(self, group: P2PGroup, prefetch: bool = False) -> None:
        """Post the group's receives once. A prefetch is skipped when a gradient's shape is not
        known yet (its activation is produced by the op about to run); the group posts it."""
        if id(group) in self.prefetched:
            return
        plan = self._group_plan(group)
        if prefetch and any(key not in self.output_shapes for key in plan.gradient_keys):
            return
        self.prefetched.add(id(group))
        if not plan.receives:
            return
        wire_dtype = self.context.wire_dtype
        keys = [key for key, *_ in plan.receives]
        receives = [ExpectedTensor(peer, self._incoming_shape(message), wire_dtype, what)
                    for _, peer, message, what in plan.receives]
        if self.context.record_timeline:
            self._produced_at.update((key, self._now()) for key in keys)
        posted = _PostedReceives(self._transport().start([], receives))
        self.received.update((key, (posted, index)) for index, key in enumerate(keys))

    def _transport(self) -> Transport:
        if self.context.transport is None:
            raise RuntimeError("the lowered list exchanges pipeline messages but the "
                               "ExecutionContext has no transport; pass one (make_transport)")
        return self.context.transport

    def _take_received(self, key) -> torch.Tensor:
        """The received tensor for ``key``, waiting for its message if it is still in flight."""
        if self._zero_grad is not None:
            self._zero_grads_now()
        posted, index = self.received.pop(key)
        if posted.tensors is not None or not self._measuring:
            if self.context.record_timeline:
                asked = self._now()
                self.messages.append(MessageRecord(key, "receive", self._produced_at.pop(key),
                                                   asked, asked))
            return posted.tensor(index)
        start = self._now()
        tensor = posted.tensor(index)
        if self.context.record_timeline:
            self.messages.append(MessageRecord(key, "receive", self._produced_at.pop(key), start,
                                               self._now()))
        self._record(f"wait {key[0][0]}{key[1]}.{key[2]}.{key[3]}", start, "communication",
                     "p2p-wait")
        self._op_start = self._now()
        return tensor

    def _zero_grads_now(self) -> None:
        """Call the context's ``zero_grad`` (once per iteration, see ExecutionContext)."""
        zero_grad, self._zero_grad = self._zero_grad, None
        if zero_grad is not None:
            zero_grad()

    def _complete_sends(self) -> None:
        start = self._now() if self._measuring else 0.0
        for pending in self.pending_sends:
            pending.wait_sent()
        if self.pending_sends:
            self._record("wait sends", start, "communication", "p2p-wait")
        self.pending_sends = []

    @staticmethod
    def _producing_key(gradient_message) -> tuple:
        """(pipeline, stage, microbatch) of the activation a gradient message belongs to."""
        return (gradient_message.pipeline, gradient_message.consumer_stage,
                gradient_message.microbatch)

    def _incoming_shape(self, message) -> tuple:
        """Shape of a received activation (declared by its consumer chunk) or gradient (that of
        the activation this rank produced for it)."""
        if message.kind == GRADIENT:
            return self.output_shapes.pop(self._producing_key(message))
        if self.context.activation_shape is not None:
            return self.context.activation_shape
        consumer = self.context.chunks[ModuleKey(message.pipeline, message.consumer_stage)]
        return tuple(consumer.input_activation_shape(self.context.microbatches[message.microbatch]))


def _prefetch_plan(ops: Sequence, handlers: Sequence[OpHandler]) -> dict:
    """{index of a compute op: the P2P groups between it and the next compute op}: their receives
    are posted before that compute op runs, so the transfer overlaps it."""
    plan: dict = {}
    last_compute = None
    for index, (op, handler) in enumerate(zip(ops, handlers)):
        if handler.computes:
            last_compute = index
        elif isinstance(op, P2PGroup) and last_compute is not None:
            plan.setdefault(last_compute, []).append(op)
    return plan


# The op types whose effect on gradients the interpreter knows: only backward-type Instructions
# accumulate into a module's parameters.
_KNOWN_OP_TYPES = (Instruction, P2PGroup, GradSyncStart, GradSyncWait)


def _overlap_arming_points(ops: Sequence, reducers: Mapping) -> dict:
    """{index in ``ops``: (the reducer to arm right before that op, the reducers of the modules
    before it in the rank's sync order)}: each module's last backward-type op (a full backward,
    or the last weight half of a split backward; the op after which the lowering places the
    module's GradSyncStart). Every parameter of the module receives its last contribution of the
    iteration there, at most once (one engine call, or weight halves whose parts own disjoint
    parameters), so a bucket whose hooks have all fired is final. The sync order is that of the
    list's GradSyncStart ops (one global order, see the lowering); a module arms only once the
    modules before it have issued their reductions (:meth:`Interpreter._arm_overlap`).

    A list holding an op of another kind (an ``extra_handlers`` op, e.g. a fused backward and
    forward) arms nothing: the interpreter cannot tell which modules it accumulates into, and
    arming before an earlier backward would launch buckets before their last contribution."""
    if any(not isinstance(op, _KNOWN_OP_TYPES) for op in ops):
        return {}
    last_backward: dict = {}
    sync_order: list = []
    for index, op in enumerate(ops):
        if isinstance(op, Instruction) and op.kind is not Kind.FORWARD:
            last_backward[ModuleKey(op.pipeline, op.stage)] = index
        elif isinstance(op, GradSyncStart):
            sync_order.append(ModuleKey(op.pipeline, op.stage))
    arming = {}
    for key, index in last_backward.items():
        if key in reducers:
            earlier = sync_order[:sync_order.index(key)] if key in sync_order else sync_order
            arming[index] = (reducers[key], tuple(reducers[k] for k in earlier if k in reducers))
    return arming


def _parameters(chunk) -> list:
    """A chunk's parameters (a chunk is a torch module that implements the stage contract)."""
    return list(chunk.parameters())


def _shape_signature(microbatch: dict) -> tuple:
    """The shapes of a micro-batch's tensors (what the saved activations depend on)."""
    return tuple(sorted((key, tuple(value.shape)) for key, value in microbatch.items()
                        if isinstance(value, torch.Tensor)))


# The built-in op kinds; read-only (an interpreter takes additional ones as ``extra_handlers``).
DEFAULT_OP_HANDLERS: Mapping[object, OpHandler] = MappingProxyType({
    Kind.FORWARD: OpHandler(Interpreter._forward, "forward-compute", computes=True),
    Kind.BACKWARD: OpHandler(Interpreter._backward, "backward-compute", computes=True),
    Kind.BACKWARD_INPUT: OpHandler(Interpreter._backward_input, "backward-input-compute",
                                   computes=True),
    Kind.BACKWARD_WEIGHT: OpHandler(Interpreter._backward_weight, "backward-weight-compute",
                                    computes=True),
    P2PGroup: OpHandler(Interpreter._communicate, "p2p-post", lane="communication"),
    GradSyncStart: OpHandler(Interpreter._start_grad_sync, "grad-sync-start"),
    GradSyncWait: OpHandler(Interpreter._start_remaining_syncs, "grad-sync-start"),
})
