"""The schemes the model compares and the one place a scheme becomes a lowered schedule.

Schedule-backed schemes (GPipe, 1F1B, Chimera variants with 2f pipelines) are built, validated
and lowered by the pure planning code; GEMS, PipeDream and PipeDream-2BW are not runtime
schedules and are modelled analytically in :mod:`megatron.performance_model.baselines`.
"""

from __future__ import annotations

from functools import lru_cache

# Scheme name -> (schedule name, schedule options); None = analytic baseline.
SCHEMES = {
    "chimera-direct": ("chimera", {"variant": "direct"}),
    "chimera-forward-doubling": ("chimera", {"variant": "forward-doubling"}),
    "chimera-backward-halving": ("chimera", {"variant": "forward-doubling"}),
    "chimera-direct-4p": ("chimera", {"variant": "direct", "num_pipelines": 4}),
    "chimera-direct-8p": ("chimera", {"variant": "direct", "num_pipelines": 8}),
    "1f1b": ("1f1b", {}),
    "gpipe": ("gpipe", {}),
    "gems": None,
    "pipedream": None,
    "pipedream-2bw": None,
}
ANALYTIC_SCHEMES = tuple(name for name, schedule in SCHEMES.items() if schedule is None)


def schedule_of(scheme: str):
    """(schedule name, options) of a schedule-backed scheme; clear error otherwise."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    if SCHEMES[scheme] is None:
        raise ValueError(f"scheme {scheme!r} is modelled analytically and has no schedule")
    return SCHEMES[scheme]


def is_chimera(scheme: str) -> bool:
    return SCHEMES.get(scheme) is not None and SCHEMES[scheme][0] == "chimera"


def num_pipelines(scheme: str) -> int:
    """Pipelines per replica unit: 2f for Chimera, 2 for GEMS (two mirrored replicas), else 1."""
    if is_chimera(scheme):
        return schedule_of(scheme)[1].get("num_pipelines", 2)
    return 2 if scheme == "gems" else 1


def num_replicas(scheme: str, data_parallel: int) -> int:
    """Ranks holding one stage: pipelines per unit × W (2W for 2-pipeline Chimera)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    return num_pipelines(scheme) * data_parallel


def schedule_microbatches(scheme: str, micro_batch_size: int, num_microbatches: int):
    """(schedule micro-batch size, schedule micro-batch count): backward halving runs the
    forward-doubling order on micro-batches of B/2, twice as many (chimera.md §3)."""
    if scheme == "chimera-backward-halving":
        if micro_batch_size % 2:
            raise ValueError(f"chimera-backward-halving needs an even micro-batch size "
                             f"(got {micro_batch_size}); halves of it run the backward")
        return micro_batch_size // 2, 2 * num_microbatches
    return micro_batch_size, num_microbatches


def check_schedule(scheme: str, num_stages: int, num_microbatches: int) -> None:
    """Raise ValueError where the schedule cannot run (D, N) (analytic schemes: any N >= 1)."""
    if scheme in ANALYTIC_SCHEMES:
        if num_microbatches < 1:
            raise ValueError(f"{scheme} needs at least one micro-batch")
        if scheme == "gems" and num_microbatches % 2:
            raise ValueError(f"gems alternates two replicas: N must be even (got {num_microbatches})")
        if scheme == "pipedream-2bw" and num_microbatches < num_stages:
            raise ValueError(f"pipedream-2bw updates every N >= D micro-batches (two weight "
                             f"versions suffice only then); got N={num_microbatches}, "
                             f"D={num_stages}")
        return
    from megatron.core.pipeline_parallel.planning.schedules import check_schedule_options
    name, options = schedule_of(scheme)
    check_schedule_options(name, num_stages, num_microbatches, **options)


def schedule_allows(scheme: str, num_stages: int, num_microbatches: int) -> bool:
    try:
        check_schedule(scheme, num_stages, num_microbatches)
    except ValueError:
        return False
    return True


def lowered_schedule(scheme: str, num_stages: int, num_microbatches: int,
                     grad_sync_policy: str = "eager-opt"):
    """(layout, lowered op lists) of a scheme, from the planning package's frozen plan. Cached."""
    return _lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy)


@lru_cache(maxsize=256)
def _lowered_schedule(scheme, num_stages, num_microbatches, grad_sync_policy):
    from megatron.core.pipeline_parallel.planning.plan import make_plan

    name, options = schedule_of(scheme)
    plan = make_plan(name, num_stages, num_microbatches, options,
                     grad_sync_policy=grad_sync_policy)
    return plan.layout, plan.lowered
