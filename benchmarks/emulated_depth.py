#!/usr/bin/env python
"""Our runtime against torch.distributed.pipelining at depth, with emulated (sleeping) stages.

    python benchmarks/emulated_depth.py                       # D = 4, 8, 16; N = D, 2D, 4D; 80 ms
    python benchmarks/emulated_depth.py --depths 4 --counts 1 --unit-ms 20 --rounds 1
    python benchmarks/emulated_depth.py --simulate-only       # the same table from the simulator
    python benchmarks/emulated_depth.py --simulate-only --message-ms 4 --overhead-ms 1.2 1.2 2.3
    python benchmarks/emulated_depth.py --profile hardware_profile.json   # a measured profile
    python benchmarks/emulated_depth.py --depths 4 --counts 2 --only "chimera split" --report-hops

Every stage is :class:`_emulated_stages.EmulatedStage`: its forward sleeps F, its backward sleeps I
(input gradient) and W (weight gradient) in two separate autograd nodes, so split-backward schedules
really split on both sides; the same module runs under both runtimes. A sleeping rank frees its
core, so D = 16 ranks fit on two cores and a cluster configuration's schedule can be rehearsed on one
machine. Messages are real gloo messages (``--activation-floats`` per micro-batch), each stage of 1/D
of the model has a real parameter of ``--param-floats`` floats (a chunk of one of its two layers, in
interleaved and V schedules, half of it; all-reduced between a stage's replicas where a schedule has
them, Chimera; updated by SGD every iteration on both sides).

Per-op times: uniform (``--unit-ms``: F = I = W per stage, or ``--forward-ms`` / ``--input-ms`` /
``--weight-ms``) or from ``--profile`` (``{"stages": [[F, I, W], ...]}`` in seconds, or
``tools/performance_model.py --measure`` output, its backward split by ``--input-share``). Our plans
are placed with the same per-stage charges (:class:`~megatron.core.pipeline_parallel.planning.
op_costs.StageCosts`).

Configurations run in interleaved rounds inside one process group per D (a slow phase of the
machine hits all of them); per configuration the median over rounds and the min-max spread.
Calibration (measured runs, per D, at the first N, unless ``--message-ms`` / ``--overhead-ms`` are
given): (1) op overheads: every rank times the emulated module of a middle stage for one F, its input
gradient alone and its weight gradient alone (after one uncounted warm-up); the medians of time minus
sleep are oF, oI, oW (sleep overrun and autograd; not our interpreter's own work per op); (2) ring
hop: a token carrying the sender's CLOCK_MONOTONIC is passed around the ring of ranks through our
transport (one message per tensor, ``--activation-floats`` floats; each rank sleeps briefly before
passing it on, the receiver blocked waiting as a stage waiting for its input is); the median one-way
hop after a warm-up lap; (3) fit: the message latency δ with which our simulator's time of Chimera
direct + split (its free-message plan, the overheads of (1) charged) equals its fastest of three
measured iterations (at most a quarter of a stage's forward): our runtime's effective per-hop cost,
everything it spends per message included; (4) timeline: two more iterations of it recorded with
the interpreter's timeline, which keeps for every message the sender's send post and the moment
the consuming op had the tensor (both CLOCK_MONOTONIC, one clock on one host); over the messages
whose consumer actually waited (longer than 1 ms: a shorter wait is the wait call and unpacking),
the median delay from send post to input ready, and its p90. ``--calibrate timeline`` (default) plans for (4)'s median, ``fit`` for (3),
``ring`` for (2); all are printed. Every rank gets the same values. A fitted δ is fitted to a
measured run, so "measured / sim calibrated" of Chimera direct + split is close to 1 by
construction: it is a diagnostic and a planning input, not evidence; measured / simulated as issue
26 asks it is the "sim free" column. ``--report-hops``: after the rounds each of our
configurations runs once more with the timeline and its message hops are printed (consumers that
waited, send post -> input ready median and p90, producing op end -> send post, the longest send
post, receives posted after their send); the Chrome traces of recorded iterations are left in the
temporary directory (``emulated_depth_timeline_D<D>``).

Configurations labelled "δ" (Chimera + split, direct and interleaved) are planned for the calibrated
δ and overheads (``--pipeline-op-costs`` with ``message_latency`` / ``op_overhead``: the
latency-tolerant plan, docs/schedules.md); the others are today's free-message plans (their
messages sent right after their producers, as the runtime plans every schedule on gloo).

Printed: efficiency = ideal compute time (one rank's share of all F, I, W) / measured iteration
time (the headline, against ideal compute); simulated efficiency and measured / simulated twice:
"sim free" (messages and overheads free, as every plan but the δ ones assumes) and "sim calibrated"
(the calibrated δ per message and overheads per op charged on both sides: ours, the lowered plan in
our simulator; PyTorch, its schedule's action order through the same timeline, each message δ after
its producer); and "sim free+all-reduce": the free simulation charging, where a layout has stage
replicas (Chimera; no other schedule of either side all-reduces), the stage all-reduce as measured
in the same run: after the rounds every rank times each of its stage all-reduces alone (start,
wait; ``ALLREDUCE_REPEATS`` times, ascending stage order), the median over ranks is charged per
sync from its last participant's start (printed as "stage all-reduce ms"); peak stored activations per rank in micro-batches of one 1F1B stage (ours: counted
by the interpreter; PyTorch: from its action order), next to the weight copies a rank holds (stages
of 1/D of the model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "tests"), os.path.dirname(os.path.abspath(
        __file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _emulated_stages import (EmulatedStage, StageTimes, emulated_loss,  # noqa: E402
                              param_floats_per_layer, profile_times, set_timer_slack,
                              uniform_times)
from _harness import format_table, oversubscription_note, torch_stage_ids  # noqa: E402

LAYERS_PER_STAGE = 2  # so interleaved / V schedules get 2 chunks of one layer per rank


def module_sizes(param_floats: int, activation_floats: int) -> tuple[int, int]:
    """(weight floats per layer, floats per activation message) for ``--param-floats`` per stage
    of 1/D of the model (:data:`LAYERS_PER_STAGE` layers) and ``--activation-floats``."""
    return param_floats_per_layer(param_floats, LAYERS_PER_STAGE), activation_floats


TORCH_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                   "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


# Marks a configuration planned for the calibrated message latency and op overheads (our_flags
# replaces it by a --pipeline-op-costs file that carries them).
LATENCY_TOLERANT = "<latency-tolerant plan>"


@dataclass(frozen=True)
class Calibration:
    """What a run spends besides compute: seconds per message hop between ranks and per op
    overheads (F, I, W). ``FREE``: the free-message plan's assumptions."""

    message_seconds: float = 0.0
    overhead_seconds: tuple = (0.0, 0.0, 0.0)
    ring_hop_seconds: float = 0.0  # the transport's raw hop (reported; 0 when not measured)
    fitted_seconds: float = 0.0  # the fitted hop (reported; 0 when not measured)
    # per recorded iteration: (median, p90) of the timeline's hop delays where the consumer waited
    timeline_hops: tuple = ()

    @property
    def charged(self) -> bool:
        return self.message_seconds > 0 or any(v > 0 for v in self.overhead_seconds)

    def describe(self) -> str:
        over = ", ".join(f"{v * 1e3:.2f}" for v in self.overhead_seconds)
        others = []
        if self.timeline_hops:
            others.append("timeline hop median (p90) per run " + ", ".join(
                f"{m * 1e3:.2f} ({p * 1e3:.2f})" for m, p in self.timeline_hops) + " ms")
        if self.ring_hop_seconds:
            others.append(f"transport ring hop {self.ring_hop_seconds * 1e3:.2f} ms")
        if self.fitted_seconds:
            others.append(f"fitted hop {self.fitted_seconds * 1e3:.2f} ms")
        ring = f" ({'; '.join(others)})" if others else ""
        return (f"message hop {self.message_seconds * 1e3:.2f} ms{ring}, op overhead F, I, W = "
                f"{over} ms")


FREE = Calibration()


def our_variants(depth: int, latency_tolerant: bool = False) -> list:
    """(label, extra flags) of our configurations at depth D; ``latency_tolerant`` adds Chimera
    + split (direct and interleaved) planned for the calibrated latency and overheads (labels
    ending in "δ")."""
    variants = [("ours 1f1b", ["--pipeline-schedule", "1f1b"]),
                ("ours 1f1b split", ["--pipeline-schedule", "1f1b", "--split-backward"]),
                ("ours interleaved-1f1b", ["--num-layers-per-virtual-pipeline-stage", "1"]),
                ("ours chimera", ["--pipeline-schedule", "chimera"]),
                ("ours chimera split", ["--pipeline-schedule", "chimera", "--split-backward"]),
                ("ours chimera interleaved split", ["--pipeline-schedule", "chimera",
                                                    "--chimera-variant", "interleaved",
                                                    "--split-backward"])]
    if depth >= 8:
        variants.append(("ours chimera 4-pipe split", ["--pipeline-schedule", "chimera",
                                                       "--chimera-pipelines", "4",
                                                       "--split-backward"]))
    if latency_tolerant:
        variants += [("ours chimera split δ", ["--pipeline-schedule", "chimera",
                                               "--split-backward", LATENCY_TOLERANT]),
                     ("ours chimera interleaved split δ",
                      ["--pipeline-schedule", "chimera", "--chimera-variant", "interleaved",
                       "--split-backward", LATENCY_TOLERANT])]
    return variants


def _config_flags(depth: int, count: int) -> list:
    """What our config needs besides the schedule (the GPT fields are unused by the emulation)."""
    return (f"--num-layers {depth * LAYERS_PER_STAGE} --hidden-size 32 --num-attention-heads 4 "
            f"--seq-length 8 --max-position-embeddings 8 --vocab-size 64 --lr 1e-3 "
            f"--train-iters 1 --mock-data --micro-batch-size 1 --global-batch-size {count} "
            f"--pipeline-model-parallel-size {depth}").split()


def equal_unit_times(depth: int, unit_ms: float) -> StageTimes:
    """Every stage's forward, input-gradient and weight-gradient halves ``unit_ms`` each."""
    unit = unit_ms / 1e3
    return uniform_times(depth, LAYERS_PER_STAGE, unit, unit, unit)


def stage_costs_of(times: StageTimes, num_stages: int):
    """Our planner's table for ``num_stages`` stages of equal layer counts (seconds)."""
    from megatron.core.pipeline_parallel.planning.op_costs import StageCosts
    return StageCosts(num_stages, per_stage=dict(enumerate(times.per_stage(num_stages))))


def ideal_seconds(times: StageTimes, depth: int, count: int) -> float:
    """One rank's share of all compute of an iteration (the no-bubble time)."""
    return count * sum(sum(stage) for stage in times.per_stage(depth)) / depth


# ------------------------------------------------------------------------------ simulation

def op_costs_file(times: StageTimes, depth: int, calibration: Calibration = FREE) -> str:
    """A ``--pipeline-op-costs`` file of the emulated per-stage times (one [F, I, W] per stage of
    D; interleaved schedules split each entry over their chunks) and, when charged, the
    calibration's message latency and op overheads, named by its content in the temporary
    directory (every rank finds the same file; written atomically)."""
    import hashlib
    import json
    import tempfile
    content: dict = {"stages": [list(stage) for stage in times.per_stage(depth)]}
    if calibration.charged:
        content["message_latency"] = calibration.message_seconds
        content["op_overhead"] = list(calibration.overhead_seconds)
    text = json.dumps(content)
    path = os.path.join(tempfile.gettempdir(), f"emulated_op_costs_D{depth}_"
                        f"{hashlib.sha1(text.encode()).hexdigest()[:12]}.json")
    if not os.path.isfile(path):
        handle, staging = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json")
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(staging, path)
    return path


def our_flags(label_flags, depth: int, count: int, times: StageTimes,
              calibration: Calibration = FREE) -> list:
    """All of one configuration's flags; split-backward plans are placed with the emulated
    per-stage charges through ``--pipeline-op-costs`` (as a user passes a measured profile), a
    latency-tolerant configuration's with ``calibration`` too."""
    flags = _config_flags(depth, count) + [flag for flag in label_flags
                                           if flag != LATENCY_TOLERANT]
    if "--split-backward" in flags:
        planned_for = calibration if LATENCY_TOLERANT in label_flags else FREE
        flags += ["--pipeline-op-costs", op_costs_file(times, depth, planned_for)]
    return flags


def our_plan(label_flags, depth: int, count: int, times: StageTimes,
             calibration: Calibration = FREE):
    """Our plan of one configuration as the runtime makes it on gloo (plan_from_config, sends
    right after their producers: PipelineRuntime.eager_sends), and the stage table it is
    simulated with (compute only)."""
    from megatron.core.pipeline_parallel.planning.plan import plan_from_config
    from megatron.training.arguments import parse_args
    config = parse_args(our_flags(label_flags, depth, count, times, calibration),
                        world_size=depth)
    plan = plan_from_config(config, eager_sends=True)
    return plan, stage_costs_of(times, plan.layout.num_stages)


def simulate_ours(flags, depth, count, times, charged: Calibration = FREE,
                  planned: Calibration = FREE, allreduce_seconds: float = 0.0):
    """(simulated seconds, peak stored per rank in 1F1B-stage micro-batches, weight copies) of
    the configuration planned with ``planned`` (used by latency-tolerant ones only), simulated
    charging ``charged``'s message latency and op overheads and, where the layout has stage
    replicas (Chimera), ``allreduce_seconds`` per stage all-reduce (from its last start)."""
    from megatron.core.pipeline_parallel.planning.simulator import simulate_plan
    plan, costs = our_plan(flags, depth, count, times, planned)
    result = simulate_plan(plan, stage_costs=costs.with_overheads(charged.overhead_seconds),
                           p2p_cost=charged.message_seconds,
                           allreduce_cost=allreduce_seconds if plan.layout.has_stage_replicas
                           else 0.0)
    scale = depth / plan.layout.num_stages  # a stage of 2D stages holds half a 1F1B stage
    copies = max(len(plan.layout.hosted(rank)) for rank in range(depth)) * scale
    return result.makespan, [p * scale for p in result.peak_activations], copies


def torch_orders(name: str, depth: int, count: int) -> tuple[list, int]:
    """Per rank, torch's compute actions of schedule ``name`` as our Instructions (pipeline 0,
    stage = torch's stage index), and the number of stages. Built from torch's own schedule code
    without creating stages."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from megatron.core.pipeline_parallel.planning.instructions import Instruction, Kind
    from megatron.core.pipeline_parallel.planning.schedules import build_schedule
    if name in ("ScheduleGPipe", "Schedule1F1B"):  # single-stage: the same order as ours
        ours = build_schedule("gpipe" if name == "ScheduleGPipe" else "1f1b", depth, count)
        return ours, depth
    kinds = {"F": Kind.FORWARD, "I": Kind.BACKWARD_INPUT, "W": Kind.BACKWARD_WEIGHT,
             "B": Kind.BACKWARD}
    schedule = object.__new__(getattr(torch_schedules, name))
    schedule.pp_group_size, schedule._n_microbatches = depth, count
    schedule.n_local_stages, schedule.num_stages = 2, 2 * depth
    schedule._num_stages = 2 * depth
    schedule.number_of_rounds = max(1, count // depth)
    schedule.microbatches_per_round = count // schedule.number_of_rounds
    if name == "ScheduleDualPipeV" and count < 2 * depth:
        raise ValueError(f"DualPipeV requires at least as many microbatches as stages "
                         f"({count} < {2 * depth})")
    if name == "ScheduleInterleaved1F1B" and count % schedule.number_of_rounds:
        raise ValueError("Interleaved1F1B needs N a multiple of its rounds")
    schedule.pipeline_order = {rank: schedule._calculate_single_rank_operations(rank)
                               for rank in range(depth)}
    if name == "ScheduleInterleavedZeroBubble":
        schedule.pipeline_order = schedule._add_bubbles_to_actions(2 * depth)
    orders = []
    for rank in range(depth):
        ops, pending = [], list(schedule.pipeline_order[rank])
        while pending:
            action = pending.pop(0)
            if action is None:
                continue
            if action.sub_actions:  # DualPipeV's overlapped F and B: one core runs them in turn
                pending[:0] = list(action.sub_actions)
                continue
            kind = kinds.get(action.computation_type.value)
            if kind is not None:
                ops.append(Instruction(kind, 0, action.stage_index, action.microbatch_index))
        orders.append(ops)
    return orders, 2 * depth


def simulate_torch(name, depth, count, times, charged: Calibration = FREE):
    """(simulated seconds, peak stored per rank in 1F1B-stage micro-batches, weight copies);
    ``charged``: message latency between ranks and op overheads."""
    from megatron.core.pipeline_parallel.planning.lowering import reference_timeline
    from megatron.core.pipeline_parallel.planning.simulator import peak_activations
    orders, num_stages = torch_orders(name, depth, count)
    costs = stage_costs_of(times, num_stages).with_overheads(charged.overhead_seconds)
    timeline = reference_timeline(orders, num_stages, stage_costs=costs,
                                  message_latency=charged.message_seconds)
    makespan = max(end for rank in timeline for _, end in rank)
    scale = depth / num_stages
    return makespan, [peak_activations(ops) * scale for ops in orders], 1.0


def simulated_table(depths, multiples, times_for, charged: Calibration = FREE) -> list:
    """Rows (D, N, label, simulated efficiency, peak stored, weight copies) with ``charged``
    charged on both sides (and our latency-tolerant plans made for it when it is not free)."""
    rows = []
    for depth in depths:
        times = times_for(depth)
        for multiple in multiples:
            count = multiple * depth
            ideal = ideal_seconds(times, depth, count)
            for label, flags in our_variants(depth, charged.charged):
                seconds, peaks, copies = simulate_ours(flags, depth, count, times, charged,
                                                       charged)
                rows.append((depth, count, label, ideal / seconds, max(peaks), copies))
            for name in TORCH_SCHEDULES:
                try:
                    seconds, peaks, copies = simulate_torch(name, depth, count, times, charged)
                except ValueError as error:
                    rows.append((depth, count, f"torch {name}", None, str(error)[:60], None))
                    continue
                rows.append((depth, count, f"torch {name}", ideal / seconds, max(peaks), copies))
    return rows


# ------------------------------------------------------------------------------ measuring

def _our_configuration(label, flags, parallel_state, depth, count, times, sizes, calibration):
    from megatron.core.runtimes.pipeline import PipelineRuntime
    from megatron.training.arguments import parse_args
    import tempfile
    trace_directory = os.path.join(tempfile.gettempdir(), f"emulated_depth_timeline_D{depth}")
    config = parse_args(our_flags(flags, depth, count, times, calibration)
                        + ["--pipeline-timeline", trace_directory], world_size=depth)
    runtime = PipelineRuntime(config, parallel_state, torch.device("cpu"))
    runtime.timeline_iteration = -1  # recorded only when step(record=True) asks
    plan = runtime.plan
    floats_per_layer, activation_floats = sizes

    def provider(config, parallel_state, *, pre_process=True, post_process=True,
                 layer_range=None):
        return EmulatedStage(times, layer_range, pre_process, post_process, floats_per_layer,
                             activation_floats)

    chunks = runtime.build_model_chunks(provider)
    reducers = runtime.build_gradient_reducers(chunks)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    microbatches = [{"x": torch.ones(1, activation_floats)} for _ in range(count)]

    def forward_step(microbatch, chunk):
        return chunk(microbatch["x"]), lambda out: (emulated_loss(out), {})

    def zero_grads():
        for reducer in reducers:
            reducer.zero_grad()

    def step(record: bool = False):
        """One iteration; ``record``: with the timeline (its trace written under the temporary
        directory), returning the iteration's message hops (collective, every rank)."""
        if record:
            runtime.timeline_iteration = runtime.iterations + 1
            runtime.log = lambda *args, **kwargs: None  # the trace file is enough
        # zeroed by the runtime where it has time, as the training loop has it do
        runtime.forward_backward(forward_step_func=forward_step, model_chunks=chunks,
                                 microbatches=microbatches, scale_loss=lambda loss: loss,
                                 gradient_reducers=reducers, forward_only=False,
                                 zero_grad=zero_grads)
        for reducer in reducers:
            reducer.wait()
        optimizer.step()
        if record:
            from megatron.core.pipeline_parallel.execution.timeline import gather_message_hops
            return gather_message_hops(runtime.last_interpreter.messages,
                                       parallel_state.pipeline_group)
        return None

    def peak():
        interpreter = runtime.last_interpreter
        stored = getattr(interpreter, "peak_stored", 0) or 0
        return stored * depth / plan.layout.num_stages

    def stage_allreduces(barrier, repeats: int = ALLREDUCE_REPEATS) -> list:
        """Seconds of each of this rank's stage all-reduces run alone (start, wait), one after
        the other in ascending stage order (one order on every rank), after a barrier; ``[]``
        without stage replicas (nothing is all-reduced then)."""
        if not plan.layout.has_stage_replicas:
            return []
        ordered = [reducer for key, reducer in sorted(runtime.reducers_by_key.items(),
                                                      key=lambda item: (item[0].stage,
                                                                        item[0].pipeline))]
        samples = []
        for _ in range(repeats):
            barrier()
            for reducer in ordered:
                start = time.perf_counter()
                reducer.start()
                reducer.wait()
                samples.append(time.perf_counter() - start)
        for reducer in ordered:
            reducer.zero_grad()
        return samples

    step.stage_allreduces = stage_allreduces  # type: ignore[attr-defined]
    return label, step, peak


def _torch_configuration(name, rank, depth, count, times, sizes):
    from torch.distributed import pipelining
    floats_per_layer, activation_floats = sizes
    num_stages, stage_ids = torch_stage_ids(name, rank, depth)
    multi = len(stage_ids) > 1
    per_stage = depth * LAYERS_PER_STAGE // num_stages
    stages, params = [], []
    for stage_id in stage_ids:
        module = EmulatedStage(times, range(stage_id * per_stage, (stage_id + 1) * per_stage),
                               stage_id == 0, stage_id == num_stages - 1, floats_per_layer,
                               activation_floats)
        params += list(module.parameters())
        stages.append(pipelining.PipelineStage(module, stage_id, num_stages, torch.device("cpu")))
    schedule = getattr(pipelining, name)(stages if multi else stages[0], n_microbatches=count,
                                         loss_fn=emulated_loss)
    optimizer = torch.optim.SGD(params, lr=1e-3)
    data = torch.ones(count, activation_floats)
    target = torch.zeros(count, activation_floats)
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids

    def step():
        optimizer.zero_grad()
        args = (data,) if first else ()
        kwargs = {"target": target, "losses": []} if last else {}
        schedule.step(*args, **kwargs)
        optimizer.step()

    return f"torch {name}", step, lambda: None


# ------------------------------------------------------------------------------ calibration

CALIBRATION_LAPS = 3  # token laps around the ring of ranks
ALLREDUCE_REPEATS = 3  # timed stage all-reduces per stage and rank (after the rounds)
CALIBRATION_OPS = 5  # timed F, I, W of the emulated module per rank (after one warm-up)


def _message_hops(parallel_state, depth: int, activation_floats: int, hold: float) -> list:
    """One-way seconds of each message hop of a token passed around the ring of pipeline ranks
    through our transport (one message per tensor): the sender writes its clock into the
    message, the receiver, blocked waiting as a stage waiting for its input is, subtracts it on
    arrival (CLOCK_MONOTONIC is shared by the processes of one machine); every rank sleeps
    ``hold`` before passing the token on, as a stage computes between messages."""
    from megatron.core.pipeline_parallel.execution.transport import (ExpectedTensor,
                                                                     OutgoingTensor,
                                                                     make_transport)
    transport = make_transport(parallel_state, None, torch.device("cpu"))
    rank = parallel_state.coords.pp
    token = torch.zeros(1, activation_floats, dtype=torch.float64)
    expected = ExpectedTensor((rank - 1) % depth, tuple(token.shape), token.dtype, "token")
    hops, pending = [], []

    def pass_on():
        time.sleep(hold)
        token[0, 0] = time.monotonic()
        pending.append(transport.start([OutgoingTensor((rank + 1) % depth, token.clone(),
                                                       "token")], []))

    def receive():
        received = transport.start([], [expected]).wait_received()[0]
        hops.append(time.monotonic() - float(received[0, 0]))

    for _ in range(CALIBRATION_LAPS + 1):  # the first lap warms the connections up
        if rank == 0:
            pass_on()
            receive()
        else:
            receive()
            pass_on()
    for exchange in pending:
        exchange.wait_sent()
    return hops[1:]


def _op_overheads(times: StageTimes, depth: int, sizes) -> list:
    """(oF, oI, oW) samples of this rank: the emulated module of a middle stage timed for one
    forward, its input gradient alone and its weight gradient alone, minus their sleeps."""
    floats_per_layer, activation_floats = sizes
    layer = (depth // 2) * LAYERS_PER_STAGE
    stage = EmulatedStage(times, range(layer, layer + LAYERS_PER_STAGE), False, False,
                          floats_per_layer, activation_floats)
    forward, input_half, weight_half = stage.seconds
    samples = []
    for repeat in range(CALIBRATION_OPS + 1):  # the first starts autograd's engine: not counted
        x = torch.ones(1, activation_floats, requires_grad=True)
        start = time.perf_counter()
        out = stage(x)
        after_forward = time.perf_counter()
        grad = torch.ones_like(out)
        torch.autograd.grad(out, [x], grad, retain_graph=True)
        after_input = time.perf_counter()
        torch.autograd.grad(out, [stage.weight], grad)
        after_weight = time.perf_counter()
        if repeat:
            samples.append((after_forward - start - forward,
                            after_input - after_forward - input_half,
                            after_weight - after_input - weight_half))
    return samples


CALIBRATION_MODES = ("timeline", "fit", "ring")
FIT_CONFIGURATION = "ours chimera split"  # the free-message plan the fit runs
FIT_STEPS = 3  # timed iterations of it (after one warm-up); the fastest is fitted
FIT_BOUND = 0.25  # the fitted hop is at most this fraction of a stage's forward
TIMELINE_RUNS = 2  # recorded iterations of it (after the timed ones); δ pools their hops


def timeline_hop_seconds(hops_per_run) -> tuple:
    """(δ, ((median, p90) per run)): δ is the median over every run's hops whose consumer waited
    (:class:`~megatron.core.pipeline_parallel.execution.timeline.MessageHop`), 0 if none did."""
    from megatron.core.pipeline_parallel.execution.timeline import hop_summary
    summaries = [hop_summary(hops) for hops in hops_per_run]
    pooled = [hop.delay for hops in hops_per_run for hop in hops if hop.waited]
    delta = statistics.median(pooled) if pooled else 0.0
    return delta, tuple((s["delay_median"], s["delay_p90"]) for s in summaries)


def calibrate(parallel_state, depth: int, count: int, times: StageTimes, sizes,
              mode: str = "timeline") -> Calibration:
    """The message hop and op overheads as the emulated run meets them; every rank gets the same
    values. Op overheads: medians of every rank's timed ops (:func:`_op_overheads`). Message hop:
    ``timeline`` (default), the median delay from a send's post (the producer's clock) to the
    consumer having the tensor, over the messages whose consumer waited, in ``TIMELINE_RUNS``
    iterations of Chimera direct + split (free-message plan) recorded with the interpreter's
    timeline (:func:`timeline_hop_seconds`); ``ring``, the median one-way hop of a token passed
    through our transport (:func:`_message_hops`); ``fit``, the δ with which our simulator's time of
    Chimera direct + split (free-message plan, the calibrated overheads charged) equals its
    fastest of ``FIT_STEPS`` measured iterations: the effective per-hop cost of our runtime,
    everything it spends per message included, at most ``FIT_BOUND`` x a stage's forward (a slow
    phase of a loaded machine is not a message cost). All three are measured and reported; ``mode``
    picks the planned one."""
    import torch.distributed as dist
    hold = min(times.per_stage(depth)[0][0], 0.02)
    sample = (_message_hops(parallel_state, depth, sizes[1], hold),
              _op_overheads(times, depth, sizes))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sample)
    hops = [hop for rank_hops, _ in gathered for hop in rank_hops]
    ops = [op for _, rank_ops in gathered for op in rank_ops]
    overheads = tuple(max(0.0, statistics.median(op[i] for op in ops)) for i in range(3))
    ring = max(0.0, statistics.median(hops))
    flags = dict(our_variants(depth))[FIT_CONFIGURATION]
    _, step, _ = _our_configuration(FIT_CONFIGURATION, flags, parallel_state, depth, count, times,
                                    sizes, FREE)
    dist.barrier()
    step()
    measured = min(_timed(step, dist.barrier) for _ in range(FIT_STEPS))
    bound = FIT_BOUND * min(stage[0] for stage in times.per_stage(depth))
    hops_per_run = [step(record=True) for _ in range(TIMELINE_RUNS)]
    recorded, per_run = timeline_hop_seconds(hops_per_run)
    fitted = [fit_message_seconds(flags, depth, count, times, overheads, measured, bound)
              if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(fitted, src=0)
    chosen = {"timeline": recorded, "fit": fitted[0], "ring": ring}[mode]
    return Calibration(chosen, overheads, ring, fitted[0], per_run)


def fit_message_seconds(flags, depth: int, count: int, times: StageTimes, overheads,
                        measured: float, upper: float = 0.05) -> float:
    """The message latency (seconds, 0..``upper``, bisection to 0.05 ms) with which the simulated
    time of configuration ``flags`` (its free-message plan, ``overheads`` charged) is
    ``measured``."""
    def simulated(message_seconds: float) -> float:
        return simulate_ours(flags, depth, count, times,
                             Calibration(message_seconds, tuple(overheads)))[0]

    low, high = 0.0, upper
    if simulated(low) >= measured:
        return 0.0
    if simulated(high) <= measured:
        return high
    while high - low > 5e-5:
        middle = (low + high) / 2
        low, high = (middle, high) if simulated(middle) < measured else (low, middle)
    return (low + high) / 2


def _timed(step, barrier) -> float:
    barrier()
    start = time.perf_counter()
    step()
    barrier()
    return time.perf_counter() - start


def _measure_rank(rank, world_size, multiples, times, sizes, rounds, only, given, mode,
                  report_hops=False):
    import logging

    import torch.distributed as dist
    from _harness import parallel_state_for
    logging.getLogger("megatron.training.config_validation").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    depth = world_size
    results: dict = {}
    calibration = given
    for multiple in multiples:
        count = multiple * depth
        variants = [(label, flags) for label, flags in our_variants(depth, True)
                    if not only or any(word in label for word in only)]
        parallel_state = parallel_state_for(rank, depth, [_config_flags(depth, count) + flags
                                                          for _, flags in our_variants(depth)])
        if calibration is None:
            calibration = calibrate(parallel_state, depth, count, times, sizes, mode)
        results["calibration"] = calibration
        configurations, skipped = [], []
        for label, flags in variants:
            configurations.append(_our_configuration(label, flags, parallel_state, depth, count,
                                                     times, sizes, calibration))
        for name in TORCH_SCHEDULES:
            if only and not any(word in f"torch {name}" for word in only):
                continue
            try:
                configurations.append(_torch_configuration(name, rank, depth, count, times,
                                                           sizes))
            except Exception as error:  # a schedule that refuses this N (DualPipeV: N < 2D)
                skipped.append(f"torch {name}: {type(error).__name__}: {error}"[:120])
        for _, step, _ in configurations:  # warm-up: torch's shape inference, allocators
            dist.barrier()
            step()
        times_by_label = {label: [] for label, _, _ in configurations}
        for _ in range(rounds):
            for label, step, _ in configurations:
                times_by_label[label].append(_timed(step, dist.barrier))
        allreduces = {label: step.stage_allreduces(dist.barrier)
                      for label, step, _ in configurations if hasattr(step, "stage_allreduces")}
        hops = {}
        if report_hops:
            from megatron.core.pipeline_parallel.execution.timeline import hop_summary
            hops = {label: hop_summary(step(record=True))
                    for label, step, _ in configurations if label.startswith("ours")}
        results[count] = {"times": times_by_label, "skipped": skipped, "hops": hops,
                          "allreduces": allreduces,
                          "peaks": {label: peak() for label, _, peak in configurations}}
    return results


def measure(depth, multiples, times, sizes, rounds, only, timeout, given=None, mode="timeline",
            report_hops=False):
    """Per rank, {N: results} and "calibration"; ``given``: a Calibration to use instead of
    calibrating at the start (``mode``: see :func:`calibrate`)."""
    from dist_harness import run_distributed
    torch.set_num_threads(1)
    return run_distributed(_measure_rank, depth, multiples, times, sizes, rounds, only, given,
                           mode, report_hops, timeout=timeout)


# ------------------------------------------------------------------------------ report

def _fmt(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def measured_report(depth, per_rank, times) -> str:
    calibration = per_rank[0]["calibration"]
    lines = [f"D = {depth}: calibrated {calibration.describe()}; 'δ' configurations are planned "
             f"for it, 'sim free' charges messages and overheads nothing, 'sim calibrated' both "
             f"sides the calibration"]
    for count, measured in per_rank[0].items():
        if count == "calibration":
            continue
        ideal = ideal_seconds(times, depth, count)
        rows, best = [], {}
        for label, seconds in measured["times"].items():
            slowest = [max(rank[count]["times"][label][i] for rank in per_rank)
                       for i in range(len(seconds))]
            median = statistics.median(slowest)
            efficiency = ideal / median
            if label.startswith("ours"):
                flags = dict(our_variants(depth, True))[label]
                simulated, peaks, copies = simulate_ours(flags, depth, count, times, FREE,
                                                         calibration)
                samples = [sample for rank in per_rank
                           for sample in rank[count].get("allreduces", {}).get(label, [])]
                allreduce = statistics.median(samples) if samples else 0.0
                with_allreduce, _, _ = simulate_ours(flags, depth, count, times, FREE,
                                                     calibration, allreduce)
                charged, _, _ = simulate_ours(flags, depth, count, times, calibration,
                                              calibration)
                stored = [rank[count]["peaks"][label] for rank in per_rank]
            else:
                simulated, peaks, copies = simulate_torch(label.split()[1], depth, count, times)
                charged, _, _ = simulate_torch(label.split()[1], depth, count, times,
                                               calibration)
                stored = peaks
                allreduce, with_allreduce = 0.0, simulated  # no stage replicas: no all-reduce
            rows.append([label, f"{median:.3f} ({min(slowest):.3f}-{max(slowest):.3f})",
                         f"{efficiency:.3f} ({ideal / max(slowest):.3f}-{ideal / min(slowest):.3f})",
                         _fmt(ideal / simulated), _fmt(simulated / median),
                         f"{allreduce * 1e3:.1f}" if allreduce else "-",
                         _fmt(with_allreduce / median),
                         _fmt(ideal / charged), _fmt(charged / median),
                         f"{max(stored):g}", f"{copies:g}"])
            side = "ours" if label.startswith("ours") else "torch"
            best[side] = max(best.get(side, (0.0, "")), (efficiency, label))
        lines.append(f"== D = {depth}, N = {count} (ideal {ideal:.3f} s per iteration) ==")
        lines.append(format_table(["configuration", "seconds (min-max)", "efficiency (range)",
                                   "sim free eff.", "measured/sim free",
                                   "stage all-reduce ms", "measured/sim free+all-reduce",
                                   "sim calibrated eff.", "measured/sim calibrated",
                                   "peak stored (1F1B-stage mb)", "weight copies"], rows))
        if measured.get("hops"):
            from megatron.core.pipeline_parallel.execution.timeline import describe_hops
            lines.append("one more iteration of each, recorded with the timeline:")
            lines += [f"  {label}: {describe_hops(summary)}"
                      for label, summary in measured["hops"].items()]
        for note in measured["skipped"]:
            lines.append(f"not run: {note}")
        if "ours" in best and "torch" in best:
            lines.append(f"best ours: {best['ours'][1]} {best['ours'][0]:.3f}; best torch: "
                         f"{best['torch'][1]} {best['torch'][0]:.3f}; ratio "
                         f"{best['ours'][0] / best['torch'][0]:.3f}")
        lines.append("")
    return "\n".join(lines)


def simulated_report(rows) -> str:
    table = [[depth, count, label, _fmt(efficiency), peaks if isinstance(peaks, str)
              else f"{peaks:g}", "-" if copies is None else f"{copies:g}"]
             for depth, count, label, efficiency, peaks, copies in rows]
    return format_table(["D", "N", "configuration", "simulated efficiency",
                         "peak stored (1F1B-stage mb)", "weight copies"], table)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4],
                        help="N as multiples of D (default 1 2 4: N = D, 2D, 4D)")
    parser.add_argument("--unit-ms", type=float, default=80.0,
                        help="F = I = W per stage, milliseconds (default 80)")
    parser.add_argument("--forward-ms", type=float, default=None)
    parser.add_argument("--input-ms", type=float, default=None)
    parser.add_argument("--weight-ms", type=float, default=None)
    parser.add_argument("--profile", default=None,
                        help="per-stage times: {'stages': [[F, I, W], ...]} seconds, or "
                             "tools/performance_model.py --measure output")
    parser.add_argument("--input-share", type=float, default=0.5,
                        help="I / B when a --measure profile gives the backward whole")
    parser.add_argument("--param-floats", type=int, default=1 << 20,
                        help="parameter floats per stage of 1/D of the model (all-reduced "
                             "between replicas); a chunk of an interleaved or V schedule holds "
                             "its layers' share")
    parser.add_argument("--activation-floats", type=int, default=1 << 14,
                        help="floats per activation message")
    parser.add_argument("--message-ms", type=float, default=None,
                        help="latency of every message hop between ranks (milliseconds), charged "
                             "on both sides and planned for by the 'δ' configurations. "
                             "--simulate-only: default 0 (messages free). Measured runs: default "
                             "calibrated at the start (see --calibrate); giving it skips the "
                             "calibration")
    parser.add_argument("--calibrate", choices=CALIBRATION_MODES, default="timeline",
                        help="how a measured run calibrates the message hop: timeline (default) "
                             "the median delay from send post to input ready over the messages "
                             "a consumer waited for, recorded by our interpreter in Chimera "
                             "direct + split; fit the latency with which our simulated Chimera "
                             "direct + split matches its measured iteration (its 'measured/sim "
                             "calibrated' is about 1 by construction); ring the one-way hop of a "
                             "token passed around the ranks through our transport (all three "
                             "reported)")
    parser.add_argument("--report-hops", action="store_true",
                        help="after the rounds, run each of our configurations once more with "
                             "the interpreter's timeline and print its message hops (send post "
                             "-> input ready, producing op end -> send post, posting time)")
    parser.add_argument("--overhead-ms", type=float, nargs=3, default=None,
                        metavar=("F", "I", "W"),
                        help="per-op overheads beyond the sleeps (milliseconds), like "
                             "--message-ms: --simulate-only default 0; measured runs default "
                             "calibrated (the emulated module's F, I and W timed on every rank)")
    parser.add_argument("--timer-slack-ns", type=int, default=None,
                        help="Linux timer slack of every rank (both runtimes alike), set before "
                             "the ranks start: how late a sleep may end (kernel default 50000 "
                             "ns); default: leave it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only configurations whose label contains one of these words")
    parser.add_argument("--simulate-only", action="store_true",
                        help="print the simulated table only (no processes)")
    parser.add_argument("--timeout", type=float, default=7200.0)
    args = parser.parse_args(argv)
    if min(args.depths) < 2 or any(d % 2 for d in args.depths):
        parser.error("--depths must be even numbers >= 2 (Chimera needs an even D)")
    if min(args.counts) < 1 or args.rounds < 1:
        parser.error("--counts and --rounds must be >= 1")
    if (args.message_ms or 0) < 0 or min(args.overhead_ms or [0]) < 0:
        parser.error("--message-ms and --overhead-ms must be >= 0 (milliseconds)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def times_for(depth: int) -> StageTimes:
        if args.profile:
            return profile_times(args.profile, depth, LAYERS_PER_STAGE, args.input_share)
        unit = args.unit_ms / 1e3
        return uniform_times(depth, LAYERS_PER_STAGE,
                             (args.forward_ms / 1e3) if args.forward_ms is not None else unit,
                             (args.input_ms / 1e3) if args.input_ms is not None else unit,
                             (args.weight_ms / 1e3) if args.weight_ms is not None else unit)

    given = None
    if args.message_ms is not None or args.overhead_ms is not None or args.simulate_only:
        given = Calibration((args.message_ms or 0.0) / 1e3,
                            tuple(v / 1e3 for v in (args.overhead_ms or (0.0, 0.0, 0.0))))
    if args.simulate_only:
        print(simulated_report(simulated_table(args.depths, args.counts, times_for, given)))
        return 0
    sizes = module_sizes(args.param_floats, args.activation_floats)
    if args.timer_slack_ns is not None:
        previous = set_timer_slack(args.timer_slack_ns)
        print(f"timer slack {args.timer_slack_ns} ns on every rank (was {previous} ns)")
    for depth in args.depths:
        times = times_for(depth)
        per_rank = measure(depth, args.counts, times, sizes, args.rounds, args.only,
                           args.timeout, given, args.calibrate, args.report_hops)
        print(measured_report(depth, per_rank, times), flush=True)
        print(oversubscription_note(depth), flush=True)
    print(f"{args.rounds} interleaved round(s); medians with (min-max) over rounds. Efficiency = "
          f"ideal compute / measured; peak stored in micro-batches of one 1F1B stage.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
