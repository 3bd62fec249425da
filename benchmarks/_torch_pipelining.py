"""The torch.distributed.pipelining side of ``vs_torch_pipelining.py``, on OUR GPT definition.

Each PyTorch stage wraps a chunk built by ``pretrain_gpt.model_provider`` with a layer range (the same
GPTModel class, the same seeded, layout-independent initialisation, so stage weights equal the
corresponding weights of our pipeline chunks and of the single-process model). The last stage returns
logits; the loss function is the mean cross entropy over the micro-batch (the mock data's loss mask
is all ones, so it equals our masked mean). Optimizer: ``torch.optim.Adam`` with our learning rate,
stepped after every schedule step (ours runs Megatron's Adam with grad clipping and loss bookkeeping).

Stage placement: single-stage schedules (1F1B) put stage r on rank r; looped schedules (Interleaved
1F1B, InterleavedZeroBubble) put stages r and r + D on rank r; V schedules (ZBVZeroBubble,
DualPipeV) put stages r and 2D - 1 - r on rank r. Each model chunk then holds num_layers / stages
layers, like our interleaved 1F1B with the same number of chunks.

Also here: a list-scheduling simulator of PyTorch's own ``pipeline_order`` (its simulated bubble)
and a saved-activation tracker for PyTorch's peak stored activation bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: label -> (torch class name, stages per rank, placement: "single", "loop" or "v").
TORCH_SCHEDULES = {
    "torch 1F1B": ("Schedule1F1B", 1, "single"),
    "torch Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, "loop"),
    "torch InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "torch ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "torch DualPipeV": ("ScheduleDualPipeV", 2, "v"),
}

#: Simulation costs per PyTorch action (F = 1, full backward B = 2 = input grad I + weight grad W).
ACTION_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def stage_indices(rank: int, depth: int, placement: str) -> list:
    """Global stage indices rank ``rank`` holds under ``placement``."""
    if placement == "single":
        return [rank]
    if placement == "loop":
        return [rank, rank + depth]
    if placement == "v":
        return [rank, 2 * depth - 1 - rank]
    raise ValueError(f"unknown placement {placement!r}")


class StageModule(torch.nn.Module):
    """One PyTorch pipeline stage: our GPT chunk with a single-tensor input and output."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.chunk(inputs)  # tokens or hidden [s, b, h] -> hidden, or logits [b, s, V]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch (logits ``[b, s, V]``, labels ``[b, s]``)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_chunk(config, stage: int, num_stages: int):
    """Our GPTModel chunk holding global stage ``stage`` of ``num_stages`` (equal layer counts)."""
    import pretrain_gpt
    from megatron.core.parallel_state import ParallelState

    num_layers = config.model.num_layers
    if num_layers % num_stages:
        raise ValueError(f"--num-layers {num_layers} must be a multiple of the {num_stages} "
                         "PyTorch stages")
    per_stage = num_layers // num_stages
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    return pretrain_gpt.model_provider(config, ParallelState.single_process(),
                                       pre_process=stage == 0,
                                       post_process=stage == num_stages - 1, layer_range=layers)


class TorchPipelineRun:
    """One PyTorch schedule on this rank: stages, schedule, optimizer, the iteration's data."""

    def __init__(self, label: str, config, rank: int, depth: int, group, microbatches: list):
        from torch.distributed import pipelining

        class_name, per_rank, placement = TORCH_SCHEDULES[label]
        num_stages = depth * per_rank
        indices = stage_indices(rank, depth, placement)
        self.chunks = [build_chunk(config, index, num_stages) for index in indices]
        stages = [pipelining.PipelineStage(StageModule(chunk), index, num_stages,
                                           torch.device("cpu"), group=group)
                  for chunk, index in zip(self.chunks, indices)]
        schedule_class = getattr(pipelining, class_name)
        num_microbatches = len(microbatches)
        self.schedule = schedule_class(stages[0] if per_rank == 1 else stages, num_microbatches,
                                       loss_fn=cross_entropy_loss)
        self.single_stage, self.depth = per_rank == 1, depth
        self.num_microbatches = num_microbatches
        self.has_first = 0 in indices
        self.has_last = num_stages - 1 in indices
        self.tokens = torch.cat([batch["tokens"] for batch in microbatches])
        self.labels = torch.cat([batch["labels"] for batch in microbatches])
        self.parameters = [p for chunk in self.chunks for p in chunk.parameters()]
        self.optimizer = torch.optim.Adam(self.parameters, lr=config.optimizer.lr)
        self.description = f"{class_name}, stages {indices} of {num_stages} on this rank"

    def step(self) -> None:
        """One training iteration: the schedule's forward/backward, then the optimizer."""
        self.optimizer.zero_grad()
        args = (self.tokens,) if self.has_first else ()
        kwargs = {"target": self.labels, "losses": []} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        self.optimizer.step()

    def simulated_bubble(self) -> float:
        """Bubble of PyTorch's own per-rank action lists, list-scheduled with ACTION_COSTS.

        Single-stage schedules execute their own loop, not ``pipeline_order`` (whose
        Schedule1F1B listing numbers micro-batches off by one on later ranks in torch 2.13), so
        Schedule1F1B gets our simulator's 1F1B, the same schedule.
        """
        if self.single_stage:
            from megatron.core.pipeline_parallel.planning.simulator import simulate_schedule

            _, _, result = simulate_schedule("1f1b", self.depth, self.num_microbatches, 1.0, 2.0)
            return result.bubble_ratio
        return simulate_pipeline_order(self.schedule.pipeline_order)


def simulate_pipeline_order(order: dict) -> float:
    """1 - work / (ranks x makespan) of PyTorch's ``pipeline_order`` at zero communication cost.

    Each rank runs its compute actions in list order; an action starts when the rank is free and
    its dependencies are done: F of (stage s, mb m) after F of (s - 1, m); B/I of (s, m) after F of
    (s, m) and B/I of (s + 1, m); W of (s, m) after I of (s, m). Returns NaN without an order.
    """
    actions = {rank: [a for a in _expand_overlaps(ops)
                      if a is not None and a.computation_type.value in ACTION_COSTS]
               for rank, ops in order.items()}
    if not actions:
        return float("nan")
    num_stages = 1 + max(a.stage_index for ops in actions.values() for a in ops)
    done, position = {}, {rank: 0 for rank in actions}
    free = {rank: 0.0 for rank in actions}
    while any(position[rank] < len(ops) for rank, ops in actions.items()):
        progressed = False
        for rank, ops in actions.items():
            while position[rank] < len(ops):
                action = ops[position[rank]]
                ready = _dependencies_done(action, done, num_stages)
                if ready is None:
                    break
                kind = action.computation_type.value
                end = max(free[rank], ready) + ACTION_COSTS[kind]
                done[(kind if kind != "B" else "I", action.stage_index,
                      action.microbatch_index)] = end
                if kind == "B":
                    done[("W", action.stage_index, action.microbatch_index)] = end
                free[rank], position[rank], progressed = end, position[rank] + 1, True
        if not progressed:
            raise RuntimeError("PyTorch's pipeline_order deadlocks in the simulator")
    makespan = max(free.values())
    work = sum(ACTION_COSTS[a.computation_type.value] for ops in actions.values() for a in ops)
    return 1.0 - work / (len(actions) * makespan)


def _expand_overlaps(ops: list) -> list:
    """DualPipeV's overlapped (F; B) pairs as their two actions, one after the other."""
    expanded = []
    for action in ops:
        expanded.extend(action.sub_actions if action is not None and action.sub_actions
                        else [action])
    return expanded


def _dependencies_done(action, done: dict, num_stages: int):
    """Finish time of the action's last dependency, or None if one is still pending."""
    kind, stage, microbatch = action.computation_type.value, action.stage_index, \
        action.microbatch_index
    if kind == "F":
        needed = [("F", stage - 1, microbatch)] if stage > 0 else []
    elif kind in ("B", "I"):
        needed = [("F", stage, microbatch)]
        if stage < num_stages - 1:
            needed.append(("I", stage + 1, microbatch))
    else:
        needed = [("I", stage, microbatch)]
    times = [done.get(key) for key in needed]
    if any(t is None for t in times):
        return None
    return max(times, default=0.0)


class SavedActivationPeak:
    """Peak bytes of activations autograd holds at once (parameters excluded); a context manager.

    Each saved tensor counts from its pack until its first unpack (the backward that consumes it)
    or until autograd frees it; tensors saved several times count once.
    """

    def __init__(self, parameters):
        self.parameter_pointers = {p.data_ptr() for p in parameters}
        self.live = {}  # key -> [references, nbytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        if tensor.layout != torch.strided or tensor.data_ptr() in self.parameter_pointers:
            return (None, tensor)
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        entry = self.live.setdefault(key, [0, tensor.numel() * tensor.element_size()])
        if entry[0] == 0:
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        return ([key], tensor)

    def _unpack(self, packed):
        holder, tensor = packed
        if holder and holder[0] is not None:
            key, holder[0] = holder[0], None
            entry = self.live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live_bytes -= entry[1]
                del self.live[key]
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
