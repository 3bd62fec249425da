"""The pipeline runtime: plugs a schedule into the training loop.

:class:`PipelineRuntime` implements the runtime protocol of :mod:`megatron.training.runtime` for
every schedule (``--pipeline-schedule 1f1b|gpipe|interleaved-1f1b|chimera``): it builds the schedule
once (build -> validate -> lower, all pure data), builds the model chunks this pipeline rank hosts,
one gradient reducer per hosted module over that stage's replica group (plus the tied-embedding
reducer), and runs each iteration through the :class:`~.interpreter.Interpreter`.

Data: the training loop hands over this data-parallel rank's N micro-batches of --micro-batch-size
(order in :mod:`megatron.training.microbatches`). Instruction micro-batch k covers samples
``ScheduleLayout.microbatch_samples(k, micro_batch_size)`` of that share (k-th micro-batch, or the
k-th half for Chimera's backward halving), so the union over all pipelines is exactly the global
batch. Each micro-batch loss is divided by the number of instruction micro-batches; the reducers
sum over a stage's replicas and divide by the data-parallel size, which equals non-pipelined
training on the same global batch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.core.parallel_state import RankLayout

from .grad_sync import build_stage_reducers, grad_norm_owners, required_group_specs
from .interpreter import ExecutionContext, Interpreter, forward_only_ops
from ..planning.lowering import lower_schedule
from .model_chunks import build_model_chunks
from .p2p import P2PTransport
from .packing import select_packer
from ..planning.schedules import build_schedule, schedule_from_config, schedule_layout
from .timeline import report_memory, write_timeline
from ..planning.validator import validate_schedule


def layout_for(config):
    """The :class:`ScheduleLayout` of the configured schedule."""
    name, options = schedule_from_config(config.parallel)
    return schedule_layout(name, config.parallel.pipeline_model_parallel_size, **options)


def lowered_schedule_for(config, packing: bool = False) -> list[list]:
    """Build, validate and lower the configured schedule (every rank's op list).

    With ``packing`` the two activations of a doubled forward step share one message."""
    parallel = config.parallel
    name, options = schedule_from_config(parallel)
    layout = layout_for(config)
    num_microbatches = config.training.num_microbatches
    schedule = build_schedule(name, parallel.pipeline_model_parallel_size, num_microbatches,
                              **options)
    validate_schedule(schedule, layout, num_microbatches)
    return lower_schedule(schedule, layout, parallel.chimera_grad_sync,
                          doubled_step_messages=packing)


def _is_tied(config) -> bool:
    return not config.model.untie_embeddings_and_output_weights


class PipelineRuntime:
    """Runs the configured pipeline schedule (see the module docstring)."""

    @staticmethod
    def required_group_ranks(config, layout: RankLayout) -> list:
        return required_group_specs(layout_for(config), layout, _is_tied(config))

    def __init__(self, config, parallel_state, device: torch.device):
        self.config = config
        self.parallel_state = parallel_state
        self.device = device
        self.layout = layout_for(config)
        self.packer = select_packer(config.parallel.p2p_packing)
        self.lowered = lowered_schedule_for(config, packing=self.packer.enabled)
        self.lowered_forward_only = [forward_only_ops(ops) for ops in self.lowered]
        self.transport = P2PTransport(parallel_state, self.packer, device)
        self.keys: list = []
        self.reducers_by_key: dict = {}
        self.final_reducers: list = []
        self._norm_owners: set = set()
        self.last_interpreter = None
        self.log = functools.partial(print, flush=True)
        self.iterations = 0
        self.peak_bytes = 0
        self.peak_stored = 0
        # --pipeline-timeline records the second training iteration (the first warms up).
        self.timeline_iteration = min(2, config.training.train_iters or 1)

    def describe(self) -> str:
        """The log lines naming the schedule and the active packing."""
        parallel = self.config.parallel
        name, options = schedule_from_config(parallel)
        details = ", ".join(f"{k}={v}" for k, v in options.items())
        return (f"> pipeline schedule: {name}" + (f" ({details})" if details else "")
                + f", {self.layout.num_pipelines} pipeline(s) x {self.layout.num_stages} stages, "
                f"grad sync {parallel.chimera_grad_sync}\n> {self.packer.describe()}")

    def build_model_chunks(self, model_provider: Callable) -> list[torch.nn.Module]:
        chunks, self.keys = build_model_chunks(model_provider, self.config, self.parallel_state,
                                               self.layout, self.device)
        return chunks

    def build_gradient_reducers(self, model_chunks) -> list:
        self.reducers_by_key, reducers = build_stage_reducers(
            model_chunks, self.keys, self.parallel_state, self.layout)
        # Reducers no GradSyncStart names (the tied embedding): started at the end of the list.
        self.final_reducers = reducers[len(self.reducers_by_key):]
        self._norm_owners = grad_norm_owners(model_chunks, self.keys, self.parallel_state.tp_rank)
        return reducers

    def owns_grad_norm(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._norm_owners

    def instruction_microbatches(self, microbatches: Sequence[dict]) -> list[dict]:
        """Instruction micro-batches from the loop's micro-batches (halves for backward halving)."""
        count = self.layout.num_schedule_microbatches(len(microbatches))
        if count == len(microbatches):
            return list(microbatches)
        micro_batch_size = self.config.training.micro_batch_size
        share = {key: torch.cat([mb[key] for mb in microbatches]) for key in microbatches[0]}
        result = []
        for index in range(count):
            samples = self.layout.microbatch_samples(index, micro_batch_size)
            result.append({key: value[samples.start:samples.stop] for key, value in share.items()})
        return result

    def forward_backward(self, *, forward_step_func, model_chunks, microbatches: Sequence[dict],
                         scale_loss: Callable, gradient_reducers, forward_only: bool,
                         autocast: Callable = contextlib.nullcontext) -> list[dict]:
        model = self.config.model
        instruction_batches = self.instruction_microbatches(microbatches)
        batch = instruction_batches[0]["tokens"].shape[0]
        if not forward_only:
            self.iterations += 1
        record = (not forward_only and self.config.logging.pipeline_timeline is not None
                  and self.iterations == self.timeline_iteration)
        if record and dist.is_initialized():
            dist.barrier()  # a common origin for every rank's clock
        context = ExecutionContext(
            chunks=dict(zip(self.keys, model_chunks)), layout=self.layout,
            transport=self.transport, forward_step_func=forward_step_func,
            microbatches=instruction_batches, loss_divisor=len(instruction_batches),
            activation_shape=(model.seq_length, batch, model.hidden_size),
            wire_dtype=next(model_chunks[0].parameters()).dtype, scale_loss=scale_loss,
            reducers=self.reducers_by_key, final_reducers=self.final_reducers,
            forward_only=forward_only, autocast=autocast, record_timeline=record)
        interpreter = Interpreter(context)
        losses = interpreter.run(self.lowered_forward_only if forward_only else self.lowered,
                                 self.parallel_state.pp_rank)
        if not forward_only:
            self.last_interpreter = interpreter
            self.peak_bytes = max(self.peak_bytes, interpreter.peak_bytes)
            self.peak_stored = max(self.peak_stored, interpreter.peak_stored)
        if record:
            write_timeline(self.config.logging.pipeline_timeline, self.iterations,
                           interpreter.timeline, self.parallel_state, self.lowered, self.log)
        return losses

    def report(self, log) -> None:
        """Collective, at the end of training: peak stored activations (and CUDA memory) of every
        rank, logged by the ranks whose ``log`` is not None."""
        report_memory(self.peak_bytes, self.peak_stored, self.device, log)
