"""The pipeline runtime: plugs a planned schedule into the training loop.

:class:`PipelineRuntime` implements :class:`~.protocol.TrainingRuntime` for every schedule family of
its ``registry`` (the built-in gpipe, 1f1b, interleaved-1f1b and chimera, or a registry of your own):
it plans the schedule once (:func:`~megatron.core.pipeline_parallel.planning.plan.plan_from_config`:
build -> validate -> lower, all pure data), builds the model chunks this pipeline rank hosts, one
gradient reduction per hosted module over that stage's replica group (plus the tied-embedding one),
and runs each iteration through the :class:`~megatron.core.pipeline_parallel.execution.interpreter.
Interpreter`.

Data: the training loop hands over this data-parallel rank's N micro-batches of --micro-batch-size
(order in :mod:`megatron.training.microbatches`). Instruction micro-batch k covers samples
``ScheduleLayout.microbatch_samples(k, micro_batch_size)`` of that share (k-th micro-batch, or the
k-th half for Chimera's backward halving), so the union over all pipelines is exactly the global
batch. Each micro-batch loss is divided by the number of instruction micro-batches; the reducers
sum over a stage's replicas and divide by the data-parallel size, which equals non-pipelined
training on the same global batch.

``--overlap-grad-reduce``: each module's reduction (of a kind that ``overlaps``) is built with
buckets and armed by the interpreter before the module's last backward op, so its buckets launch
during that op (as Megatron-LM launches each model chunk's buckets during its last micro-batch's
backward); the schedule's GradSyncStart launches the rest.
"""

from __future__ import annotations

import contextlib
import functools
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.distributed.gradient_reducer import OVERLAP_BUCKET_SIZE
from megatron.core.distributed.reducers import BUILTIN_REDUCERS
from megatron.core.parallel_state import RankLayout
from megatron.core.pipeline_parallel.execution.instruction_timing import InstructionSeconds
from megatron.core.pipeline_parallel.execution.interpreter import (ExecutionContext, Interpreter,
                                                                   OpHandler)
from megatron.core.pipeline_parallel.execution.model_chunks import build_model_chunks
from megatron.core.pipeline_parallel.execution.packing import select_packer
from megatron.core.pipeline_parallel.execution.replica_groups import (grad_norm_owners,
                                                                      pipeline_reducers,
                                                                      required_group_specs)
from megatron.core.pipeline_parallel.execution.stage import check_stage_module
from megatron.core.pipeline_parallel.execution.timeline import report_memory, write_timeline
from megatron.core.pipeline_parallel.execution.transport import make_transport
from megatron.core.pipeline_parallel.planning.plan import (PipelinePlan, layout_from_config,
                                                          plan_from_config)
from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES
from megatron.core.pipeline_parallel.planning.stage_split import config_stage_layer_ranges


def _is_tied(config) -> bool:
    return config.model.tied_embeddings  # every model section declares it (model_spec.py)


class PipelineRuntime:
    """Runs the configured pipeline schedule (see the module docstring).

    ``registry`` (a class attribute) holds the schedule families this runtime knows; a subclass
    with another registry runs families of its own. ``extra_op_handlers`` (op kind ->
    :class:`OpHandler`) likewise gives the interpreter op kinds beyond the built-in ones, and
    ``reducer_table`` the gradient reducers ``--dp-gradient-reducer`` names.
    """

    registry = BUILTIN_SCHEDULES
    extra_op_handlers: Mapping[object, OpHandler] = MappingProxyType({})
    reducer_table = BUILTIN_REDUCERS

    @classmethod
    def required_group_ranks(cls, config, layout: RankLayout) -> list:
        kind = cls.reducer_table.get(config.parallel.dp_gradient_reducer)
        return required_group_specs(layout_from_config(config, cls.registry), layout,
                                    _is_tied(config), split_directions=kind.needs_direction_groups)

    def __init__(self, config, parallel_state, device: torch.device):
        self.config = config
        self.parallel_state = parallel_state
        self.device = device
        self.packer = select_packer(config.parallel.p2p_packing)
        self.transport = make_transport(parallel_state, self.packer, device)
        # Where sends complete in the background (gloo), every message is sent right after its
        # producer: the same compute order and planned makespan, and a message travels during
        # its round's slack instead of being posted just before its consumer needs it.
        self.eager_sends = self.transport.sends_complete_in_background()
        self.plan = plan_from_config(config, doubled_step_messages=self.packer.enabled,
                                     registry=self.registry, eager_sends=self.eager_sends)
        self.layout = self.plan.layout
        # Plans by micro-batch count: the full batch's, and smaller ones while a
        # --rampup-batch-size ramp runs (each planned once, when first needed).
        self._plans = {config.training.num_microbatches: self.plan}
        self.keys: list = []
        self.reducers_by_key: dict = {}
        self.final_reducers: list = []
        self._norm_owners: set = set()
        self.last_interpreter = None
        self.saved_bytes_cache: dict = {}
        self.group_plans: dict = {}  # the interpreter's resolved P2P groups, across iterations
        self.log = functools.partial(print, flush=True)
        self.iterations = 0
        self.peak_bytes = 0
        self.peak_stored = 0
        # --pipeline-timeline records the second training iteration (the first warms up).
        self.timeline_iteration = min(2, config.training.train_iters or 1)

    def describe(self) -> str:
        """The log lines naming the schedule, the layers of each stage and the active packing."""
        layers = [len(stage) for stage in config_stage_layer_ranges(self.config,
                                                                     self.layout.num_stages)]
        return (f"> pipeline schedule: {self.plan.describe()}\n"
                f"> transformer layers per pipeline stage: {layers}\n> {self.packer.describe()}")

    def build_model_chunks(self, model_provider: Callable) -> list[torch.nn.Module]:
        chunks, self.keys = build_model_chunks(model_provider, self.config, self.parallel_state,
                                               self.layout, self.device)
        for chunk in chunks:
            check_stage_module(chunk)
        return chunks

    def build_gradient_reducers(self, model_chunks) -> list:
        parallel = self.config.parallel
        overlap = parallel.overlap_grad_reduce
        reducers = pipeline_reducers(model_chunks, self.keys, self.parallel_state, self.layout,
                                     sharded=parallel.use_distributed_optimizer,
                                     parallel=parallel,
                                     kind=self.reducer_table.get(parallel.dp_gradient_reducer),
                                     overlap=overlap,
                                     bucket_size=OVERLAP_BUCKET_SIZE if overlap else None)
        self.reducers_by_key = reducers.by_module
        # Reducers no GradSyncStart names (the tied embedding): started at the end of the list.
        self.final_reducers = reducers.final
        self._norm_owners = grad_norm_owners(model_chunks, self.keys, self.parallel_state.tp_rank)
        return reducers.all

    def owns_grad_norm(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._norm_owners

    def plan_for(self, num_microbatches: int) -> PipelinePlan:
        """The schedule's plan for ``num_microbatches`` loop micro-batches (cached)."""
        if num_microbatches not in self._plans:
            self._plans[num_microbatches] = plan_from_config(
                self.config, doubled_step_messages=self.packer.enabled, registry=self.registry,
                num_microbatches=num_microbatches, eager_sends=self.eager_sends)
        return self._plans[num_microbatches]

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
                         autocast: Callable = contextlib.nullcontext,
                         instruction_seconds: Optional[InstructionSeconds] = None,
                         zero_grad: Optional[Callable[[], None]] = None) -> list[dict]:
        instruction_batches = self.instruction_microbatches(microbatches)
        plan = self.plan_for(len(microbatches))
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
            wire_dtype=next(model_chunks[0].parameters()).dtype, scale_loss=scale_loss,
            reducers=self.reducers_by_key, final_reducers=self.final_reducers,
            forward_only=forward_only, autocast=autocast, record_timeline=record,
            saved_bytes_cache=self.saved_bytes_cache, instruction_seconds=instruction_seconds,
            group_plans=self.group_plans, zero_grad=None if forward_only else zero_grad,
            overlap_grad_reduce=self.config.parallel.overlap_grad_reduce)
        interpreter = Interpreter(context, self.extra_op_handlers)
        losses = interpreter.run(plan.forward_only if forward_only else plan.lowered,
                                 self.parallel_state.pp_rank)
        if not forward_only:
            self.last_interpreter = interpreter
            self.peak_bytes = max(self.peak_bytes, interpreter.peak_bytes)
            self.peak_stored = max(self.peak_stored, interpreter.peak_stored)
        if record:
            write_timeline(self.config.logging.pipeline_timeline, self.iterations,
                           interpreter.timeline, self.parallel_state, plan.lowered, self.log)
        return losses

    def report(self, log) -> None:
        """Collective, at the end of training: peak stored activations (and CUDA memory) of every
        rank, logged by the ranks whose ``log`` is not None."""
        report_memory(self.peak_bytes, self.peak_stored, self.device, log)
