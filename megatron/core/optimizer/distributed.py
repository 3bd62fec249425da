"""``--use-distributed-optimizer``: each rank steps only its shard of every stage it holds.

The gradient reducers (:class:`~megatron.core.distributed.sharded_reducer.ShardedGradientReducer`,
one per model chunk, over the group of all replicas of the chunk's stage) reduce-scatter the
gradients, so rank k of a stage's R replicas holds the reduced gradient of 1/R of the stage's
elements. :class:`DistributedOptimizer` runs Megatron's step on those shards only (fp32 weights =
the model's own fp32 parameters, as mixed precision here changes only the forward; AdamW state for
the shard only), then every reducer all-gathers the updated shards into all replicas.

Under Chimera a stage's replicas are both pipeline directions times data parallel (2W ranks), so a
Chimera rank steps 1/(2W) of each of its two stages: the same optimizer work and state as a 1F1B rank
at the same W, instead of twice as much. Parameters outside the sharded reducers (the tied word
embedding's copies, kept identical by their own all-reduce) are stepped whole, as before.

Gradient norm (for clipping and the log): each element of a stage is owned by exactly one replica,
so the squared norms of the shards are summed over every rank (tensor-parallel-replicated elements
counted on tensor-parallel rank 0 only); the replicated parameters' part is summed as without the
distributed optimizer. Loss scaling and overflow skipping act on the shards unchanged.

``--decoupled-lr``: the word-embedding and output-layer weights are marked before the reducers are
built, which gives them flat segments of their own; their shards (and the replicated tied copies)
go into the decoupled parameter groups, so every element follows the same schedule as without the
distributed optimizer. ``--use-mup`` works the same way with the parameters' ``mup_class``.

``--overlap-param-gather`` (Megatron's): the all-gather of the updated shards is started after the
step and not waited for; each model chunk waits for the gathers of its own parameters just before
its next forward pass (a forward pre-hook), so the communication overlaps with the end of the
iteration, the next batch's preparation and the forward passes of the chunks before it. Anything
else that reads the parameters first (checkpoint saving, the params norm, the end of training)
calls :meth:`DistributedOptimizer.finish_parameter_gather`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.collectives import all_reduce_over
from megatron.core.distributed.timeouts import awaiting, describe_group
from megatron.core.optimizer.clip_grads import default_owns_grad_norm, squared_grad_norm
from megatron.core.optimizer.decoupled_lr import (embedding_or_output_parameters, is_marked,
                                                  split_decoupled_groups)
from megatron.core.optimizer.grad_scaler import build_grad_scaler
from megatron.core.optimizer.mup import mup_width_mult, split_mup_groups
from megatron.core.optimizer.optimizer import (CountedOnce, MegatronOptimizer,
                                               build_param_groups, torch_optimizer)


def _world_group():
    """The group every rank belongs to (the shards' elements are summed over it); None without a
    process group (one process)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class DistributedOptimizer(MegatronOptimizer):
    """Megatron's step over this rank's shards (see the module docstring).

    Args:
        sharded_reducers: the reducers whose shards this rank steps (and gathers afterwards).
        replicated: parameters stepped whole (the tied embedding copies).
        model_params: every parameter of this rank's chunks (their gradients are zeroed).
    """

    def __init__(self, optimizer, sharded_reducers: list, replicated: list, model_params: list,
                 parallel_state, *, overlap_param_gather: bool = False, model_chunks=(),
                 **kwargs):
        shards = [shard for reducer in sharded_reducers for shard in reducer.shards]
        super().__init__(optimizer, shards + replicated, parallel_state, **kwargs)
        self.sharded_reducers = sharded_reducers
        self.shards = shards
        self.replicated = replicated
        self.model_params = [p for p in model_params if p.requires_grad]
        self._owns_element = default_owns_grad_norm(parallel_state)
        self.overlap_param_gather = overlap_param_gather
        self.pending_gathers: dict[int, list] = {}  # reducer index -> handles in flight
        if overlap_param_gather:
            if not model_chunks:
                raise ValueError("--overlap-param-gather needs the model chunks, to wait for "
                                 "their parameters before their forward passes")
            self._attach_forward_waits(model_chunks)

    def _attach_forward_waits(self, model_chunks) -> None:
        """A forward pre-hook per chunk that waits for the gathers of the chunk's parameters."""
        for chunk in model_chunks:
            chunk_params = {id(p) for p in chunk.parameters()}
            own = [index for index, reducer in enumerate(self.sharded_reducers)
                   if any(id(p) in chunk_params for p in reducer.params)]
            chunk.register_forward_pre_hook(
                lambda module, args, own=tuple(own): self.finish_parameter_gather(own))

    def global_grad_norm(self) -> float:
        state = self.parallel_state
        shard_squares = squared_grad_norm(self.shards, self._owns_element, state)
        all_reduce_over(shard_squares, [_world_group()])
        replicated_squares = squared_grad_norm(self.replicated, self.owns_grad_norm, state)
        all_reduce_over(replicated_squares, [state.tensor_group, state.pipeline_group])
        return float((shard_squares + replicated_squares.to(shard_squares.device)).sqrt().item())

    def counted_once(self) -> list[CountedOnce]:
        """The shards' elements over every rank (each owned by one replica of its stage; the
        padding to the replica count left out), and the parameters stepped whole as without the
        distributed optimizer (see :meth:`MegatronOptimizer.counted_once`)."""
        values: list[torch.Tensor] = []
        grads: list[Optional[torch.Tensor]] = []
        for reducer in self.sharded_reducers:
            for shard, (start, length, total) in zip(reducer.shards, reducer.shard_ranges()):
                if not self._owns_element(shard):
                    continue
                unpadded = max(0, min(length, total - start))
                values.append(shard.detach()[:unpadded])
                grads.append(None if shard.grad is None else shard.grad[:unpadded])
        owned = [param for param in self.replicated if self.owns_grad_norm(param)]
        state = self.parallel_state
        return [CountedOnce(values, grads, [_world_group()]),
                CountedOnce([param.detach() for param in owned], [param.grad for param in owned],
                            [state.tensor_group, state.pipeline_group])]

    def after_update(self) -> None:
        self.finish_parameter_gather()  # a step never starts while the last gather is in flight
        for index, reducer in enumerate(self.sharded_reducers):
            handles = reducer.start_parameter_gather()
            if handles:
                self.pending_gathers[index] = handles
        if not self.overlap_param_gather:
            self.finish_parameter_gather()

    def finish_parameter_gather(self, reducer_indices=None) -> None:
        """Wait for the parameter all-gathers in flight (of the given reducers; default all)."""
        indices = [index for index in (self.pending_gathers if reducer_indices is None
                                       else reducer_indices) if index in self.pending_gathers]
        if not indices:
            return
        with awaiting(lambda: "the parameter all-gather of the distributed optimizer on "
                      + ", ".join(describe_group("gradient-replica",
                                                 self.sharded_reducers[index].group)
                                  for index in indices)):
            for index in indices:
                for handle in self.pending_gathers.pop(index):
                    handle.wait()

    def zero_grad(self) -> None:
        grads = [p.grad for p in self.model_params + self.shards if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def shard_nbytes(self) -> int:
        """Bytes of weights this rank steps (Adam keeps two more tensors of this size)."""
        return sum(p.numel() * p.element_size() for p in self.params)


def decoupled_shards_and_copies(sharded: list, shards: list, replicated: list,
                                 model_chunks) -> set[int]:
    """``id()`` of the shards cut from embedding/output weights and of such weights stepped whole.

    Raises when such a weight went into a reducer unmarked: its shard would mix it with others."""
    embedding_or_output = embedding_or_output_parameters(model_chunks)
    unmarked = [p for reducer in sharded for p in reducer.params
                if id(p) in embedding_or_output and not is_marked(p)]
    if unmarked:
        raise ValueError("--decoupled-lr with --use-distributed-optimizer needs the embedding and "
                         "output weights marked (mark_embedding_or_output_parameters) before the "
                         "sharded gradient reducers are built; otherwise their shards mix them with "
                         "other weights")
    return ({id(shard) for shard in shards if is_marked(shard)}
            | {id(p) for p in replicated if id(p) in embedding_or_output})


def build_distributed_optimizer(config, params: list, parallel_state,
                                owns_grad_norm: Optional[Callable], reducers: list,
                                model_chunks: list = ()) -> DistributedOptimizer:
    """The distributed optimizer over ``reducers``' shards and the parameters no shard covers."""
    sharded = [reducer for reducer in reducers if reducer.shards_gradients]
    if not sharded:
        raise ValueError("--use-distributed-optimizer needs the sharded gradient reducers; the "
                         "runtime built none (it must pass use_distributed_optimizer to "
                         "build_gradient_reducers)")
    covered = {id(p) for reducer in sharded for p in reducer.params}
    replicated = [p for p in params if p.requires_grad and id(p) not in covered]
    shards = [shard for reducer in sharded for shard in reducer.shards]
    groups = build_param_groups(shards + replicated, config.optimizer.weight_decay)
    if getattr(config.optimizer, "decoupled_lr", None) is not None:
        groups = split_decoupled_groups(
            groups, decoupled_shards_and_copies(sharded, shards, replicated, model_chunks),
            config.optimizer)
    groups = split_mup_groups(groups, config.optimizer, mup_width_mult(config))
    optimizer, implementation = torch_optimizer(groups, config.optimizer)
    return DistributedOptimizer(
        optimizer, sharded, replicated, params, parallel_state,
        clip_grad=config.optimizer.clip_grad,
        grad_scaler=build_grad_scaler(config.optimizer, config.training),
        owns_grad_norm=owns_grad_norm,
        overlap_param_gather=config.parallel.overlap_param_gather, model_chunks=model_chunks,
        implementation=f"{implementation}, distributed (sharded over each stage's replicas)"
                       + (", parameter all-gather overlapped with the next forward"
                          if config.parallel.overlap_param_gather else ""))
