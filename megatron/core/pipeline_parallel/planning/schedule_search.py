"""Search schedule variants with the simulator; keep the fastest within a memory budget.

The variants: 1F1B and interleaved 1F1B with and without split backward (ZB-H1 with it), Chimera
direct with 2f = 2, 4, ... pipelines with and without split backward (the split planner decides per
plan whether first stages' backwards are deferred, see :mod:`.schedules.split_backward`), interleaved
Chimera (two directions of 2D half-size stages, :mod:`.schedules.chimera_interleaved`) and Chimera
forward doubling. Each is planned and simulated with the same per-stage charges
(:class:`~.op_costs.StageCosts`). A candidate *fits* when no rank stores more activations than
``max_activations`` micro-batches of a 1F1B stage (default D: 1F1B's busiest rank) and no rank holds
more than ``max_weight_copies`` stages' weights of 1/D of the model each (default 2: Chimera's two
pipelines; 1F1B holds 1, Chimera with 2f pipelines 2f). :func:`best_schedule` returns the fastest
fitting candidate. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .op_costs import StageCosts, uniform_stage_costs


@dataclass(frozen=True)
class Candidate:
    """One simulated schedule variant.

    Attributes:
        name, options, split_backward: what :func:`~.plan.make_plan` takes.
        makespan: simulated iteration time (cost units of the stage table).
        peak_activations: most activations any rank stores, in micro-batches of a 1F1B stage
            (stage size 1/D of the model).
        weight_copies: most stages of 1/D of the model any rank holds.
        fits: whether both are within the search's budget.
    """

    name: str
    options: dict = field(default_factory=dict)
    split_backward: Optional[int] = None
    makespan: float = 0.0
    peak_activations: float = 0.0
    weight_copies: float = 0.0
    fits: bool = True

    def describe(self) -> str:
        options = ", ".join(f"{key}={value}" for key, value in self.options.items())
        split = " + split backward" if self.split_backward is not None else ""
        return f"{self.name}" + (f" ({options})" if options else "") + split


def candidate_configurations(pipeline_size: int, num_microbatches: int) -> list[tuple]:
    """(name, options, split_backward) of every variant the search simulates at (D, N)."""
    configurations: list[tuple[str, dict[str, object], Optional[int]]] = []
    for split in (None, 0):
        configurations.append(("1f1b", {}, split))
        configurations.append(("interleaved-1f1b", {"num_model_chunks": 2}, split))
        if pipeline_size % 2 == 0:
            pipelines = 2
            while pipelines <= pipeline_size and (pipeline_size // 2) % (pipelines // 2) == 0:
                configurations.append(("chimera", {"num_pipelines": pipelines,
                                                   "variant": "direct"}, split))
                pipelines *= 2
            configurations.append(("chimera", {"num_pipelines": 2, "variant": "interleaved"},
                                   split))
            if num_microbatches % pipeline_size == 0:
                configurations.append(("chimera", {"num_pipelines": 2,
                                                   "variant": "forward-doubling"}, split))
    return configurations


def search_schedules(pipeline_size: int, num_microbatches: int, *,
                     stage_costs: Optional[Callable[[int], StageCosts]] = None,
                     max_activations: Optional[float] = None, max_weight_copies: float = 2,
                     p2p_cost: float = 0.0) -> list[Candidate]:
    """Every candidate of :func:`candidate_configurations`, simulated; fastest first.

    ``stage_costs(num_stages)`` gives the table for a schedule with that many stages per pipeline
    (default: F = 1, B = 2 per 1F1B stage, split to the stage count). ``p2p_cost`` (message
    latency δ) is charged by the simulator and, where the table gives none, planned for: every
    candidate is then the latency-tolerant plan (:func:`~.plan.make_plan`).
    """
    from .plan import make_plan
    from .simulator import simulate_plan

    depth = pipeline_size
    budget = depth if max_activations is None else max_activations

    def default_costs(num_stages: int) -> StageCosts:
        share = depth / num_stages
        return uniform_stage_costs(num_stages, share, 2 * share)

    def planning_costs(num_stages: int) -> StageCosts:
        table = (stage_costs or default_costs)(num_stages)
        if p2p_cost > 0 and table.message_latency == 0:  # plan latency-tolerant
            return table.with_overheads(table.op_overhead, p2p_cost)
        return table

    table_for = stage_costs or default_costs
    results = []
    for name, options, split in candidate_configurations(depth, num_microbatches):
        try:
            plan = make_plan(name, depth, num_microbatches, options, split_backward=split,
                             stage_costs=planning_costs(_num_stages(name, depth, options)))
        except ValueError:  # a variant this (D, N) does not allow
            continue
        costs = table_for(plan.layout.num_stages)
        result = simulate_plan(plan, p2p_cost=p2p_cost, stage_costs=costs)
        scale = depth / plan.layout.num_stages * float(plan.layout.microbatch_fraction)
        peak = max(result.peak_activations) * scale
        copies = max(len(plan.layout.hosted(rank)) for rank in range(depth)) * (
            depth / plan.layout.num_stages)
        results.append(Candidate(name, dict(options), split, result.makespan, peak, copies,
                                 peak <= budget + 1e-9 and copies <= max_weight_copies + 1e-9))
    return sorted(results, key=lambda candidate: candidate.makespan)


def best_schedule(pipeline_size: int, num_microbatches: int, **search) -> Candidate:
    """The fastest candidate within the budget (see :func:`search_schedules`)."""
    fitting = [c for c in search_schedules(pipeline_size, num_microbatches, **search) if c.fits]
    if not fitting:
        raise ValueError(f"no schedule variant fits the memory budget at D = {pipeline_size}, "
                         f"N = {num_microbatches}; raise max_activations or max_weight_copies")
    return fitting[0]


def _num_stages(name: str, depth: int, options: dict) -> int:
    from .schedules import schedule_layout
    return schedule_layout(name, depth, **options).num_stages
