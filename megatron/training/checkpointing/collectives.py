"""Collectives of the checkpointing protocol: every rank learns every rank's error, so a failure
raises everywhere instead of leaving a rank waiting (collectives use --distributed-timeout-minutes).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megatron.core.parallel_state import RankCoords

def _distributed(parallel_state) -> bool:
    return parallel_state.world_size > 1 and dist.is_available() and dist.is_initialized()


def _all_gather(parallel_state, value) -> list:
    """``value`` of every rank, in rank order (``[value]`` in one process)."""
    if not _distributed(parallel_state):
        return [value]
    gathered = [None] * parallel_state.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _raise_for_failures(errors: list, what: str) -> None:
    """Raise naming every rank whose entry of ``errors`` (rank order) is a message."""
    failures = [(rank, message) for rank, message in enumerate(errors) if message]
    if failures:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
        raise RuntimeError(f"{what} failed on {len(failures)} rank(s): {details}")


def _raise_if_any_failed(parallel_state, error: Optional[str], what: str) -> None:
    """Share ``error`` (None = success) with every rank; raise on all ranks if any failed."""
    _raise_for_failures(_all_gather(parallel_state, error), what)


def _gather_rng_states_over_data_parallel(parallel_state, state: Optional[dict]
                                          ) -> Optional[list]:
    """Every data-parallel rank's ``state`` (its RNG state), on data-parallel rank 0 (None
    elsewhere). Collective over the data-parallel group."""
    if parallel_state.dp_size == 1 or not _distributed(parallel_state):
        return [state]
    coords = parallel_state.coords
    writer = parallel_state.layout.rank(RankCoords(tp=coords.tp, dp=0, pp=coords.pp))
    gathered = [None] * parallel_state.dp_size if parallel_state.rank == writer else None
    dist.gather_object(state, gathered, dst=writer, group=parallel_state.data_group)
    return gathered


