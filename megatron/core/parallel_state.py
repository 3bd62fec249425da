"""Process layout: pure rank arithmetic, and one function that turns it into process groups.

Megatron's order: tensor-parallel rank varies fastest, then data-parallel, then pipeline, so

    rank = tp_rank + TP * (dp_rank + DP * pp_rank).

:class:`RankLayout` is plain integers (testable at world sizes in the thousands without processes).
:func:`create_parallel_state` creates the torch process groups once and returns them in an immutable
:class:`ParallelState` handle that is passed explicitly to whoever needs it; there are no module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits on the three axes."""

    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class RankLayout:
    """Sizes of the three parallel axes; all rank arithmetic lives here."""

    tensor_parallel_size: int
    data_parallel_size: int
    pipeline_parallel_size: int

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_world_size(cls, world_size: int, tensor_parallel_size: int,
                        pipeline_parallel_size: int) -> "RankLayout":
        """Derive the data-parallel size; raise if TP x PP does not divide the world size."""
        model_parallel = tensor_parallel_size * pipeline_parallel_size
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor-model-parallel-size "
                f"{tensor_parallel_size} x pipeline-model-parallel-size {pipeline_parallel_size}; "
                f"launch a multiple of {model_parallel} processes or change the sizes")
        return cls(tensor_parallel_size, world_size // model_parallel, pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size * self.pipeline_parallel_size

    def rank(self, coords: RankCoords) -> int:
        """Global rank of the given coordinates."""
        return coords.tp + self.tensor_parallel_size * (
            coords.dp + self.data_parallel_size * coords.pp)

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        tp = rank % self.tensor_parallel_size
        rest = rank // self.tensor_parallel_size
        return RankCoords(tp=tp, dp=rest % self.data_parallel_size,
                          pp=rest // self.data_parallel_size)

    def _group_along(self, rank: int, axis: str) -> list[int]:
        here = self.coords(rank)
        size = {"tp": self.tensor_parallel_size, "dp": self.data_parallel_size,
                "pp": self.pipeline_parallel_size}[axis]
        return [self.rank(RankCoords(**{**here.__dict__, axis: i})) for i in range(size)]

    def tensor_group(self, rank: int) -> list[int]:
        """Ranks sharing this rank's data and pipeline coordinates (consecutive)."""
        return self._group_along(rank, "tp")

    def data_group(self, rank: int) -> list[int]:
        """Ranks holding the same model shard on different data."""
        return self._group_along(rank, "dp")

    def pipeline_group(self, rank: int) -> list[int]:
        """Ranks forming this rank's pipeline, ordered by pipeline rank."""
        return self._group_along(rank, "pp")

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along one axis ('tp', 'dp' or 'pp'), each once, ordered by first rank."""
        sizes = {"tp": self.tensor_parallel_size, "dp": self.data_parallel_size,
                 "pp": self.pipeline_parallel_size}
        if axis not in sizes:
            raise ValueError(f"axis must be 'tp', 'dp' or 'pp', got {axis!r}")
        # rank = tp + TP * (dp + DP * pp): moving one step along ``axis`` adds ``stride``.
        stride = {"tp": 1, "dp": self.tensor_parallel_size,
                  "pp": self.tensor_parallel_size * self.data_parallel_size}[axis]
        block = stride * sizes[axis]  # ranks covered before the pattern repeats
        return [[first + step * stride for step in range(sizes[axis])]
                for base in range(0, self.world_size, block)
                for first in range(base, base + stride)]

    def pipeline_ranks_group(self, pipeline_ranks: Iterable[int], rank: int) -> list[int]:
        """Ranks with this rank's TP coordinate, any DP coordinate and the given pipeline ranks.

        Used for groups that span pipeline positions, e.g. the replicas of a Chimera stage
        (pipeline ranks s and D-1-s over all data-parallel replicas) or tied embeddings.
        """
        here = self.coords(rank)
        return sorted(self.rank(RankCoords(here.tp, dp, pp))
                      for pp in sorted(set(pipeline_ranks))
                      for dp in range(self.data_parallel_size))

    def all_pipeline_ranks_groups(self, pipeline_ranks: Iterable[int]) -> list[list[int]]:
        """:meth:`pipeline_ranks_group` for every TP coordinate."""
        pipeline_ranks = sorted(set(pipeline_ranks))
        first = self.rank(RankCoords(0, 0, pipeline_ranks[0]))
        return [self.pipeline_ranks_group(pipeline_ranks, first + tp)
                for tp in range(self.tensor_parallel_size)]


@dataclass(frozen=True)
class GroupSpec:
    """A process group to create: its ranks and a label that keeps equal rank sets apart.

    Two groups over the same ranks but with different labels are different process groups, so
    collectives on them never pair up by accident (e.g. the replicas of Chimera stages 0 and D-1
    live on the same ranks but each stage gets its own group).
    """

    label: str
    ranks: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(sorted(self.ranks)))


def _group_key(entry) -> tuple[str, tuple[int, ...]]:
    if isinstance(entry, GroupSpec):
        return entry.label, entry.ranks
    return "", tuple(sorted(entry))


@dataclass(frozen=True)
class ParallelState:
    """Explicit handle of this rank's position and process groups.

    Group attributes are ``torch.distributed`` process groups, or ``None`` in a single process
    (every collective over a group of size 1 is then skipped). ``extra_groups`` holds groups created
    by later subsystems (e.g. Chimera replica groups), keyed by (label, sorted ranks); read them with
    :meth:`group_for`.
    """

    layout: RankLayout
    rank: int
    tensor_group: Any = None
    data_group: Any = None
    pipeline_group: Any = None
    backend: str = "gloo"
    extra_groups: dict = field(default_factory=dict, compare=False)

    @classmethod
    def single_process(cls) -> "ParallelState":
        """The trivial layout: one rank, no process groups."""
        return cls(layout=RankLayout(1, 1, 1), rank=0)

    @property
    def coords(self) -> RankCoords:
        return self.layout.coords(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def dp_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def group_for(self, ranks: Iterable[int], label: str = "") -> Any:
        """The process group over exactly ``ranks`` with ``label`` (created with the state)."""
        key = _group_key(GroupSpec(label, tuple(ranks)))
        if len(key[1]) == 1:
            return None
        if key not in self.extra_groups:
            raise KeyError(f"no process group was created for ranks {key[1]} (label {label!r}); "
                           f"add it to create_parallel_state(extra_group_ranks=...)")
        return self.extra_groups[key]


def create_parallel_state(layout: RankLayout, rank: int, backend: str,
                          extra_group_ranks: Iterable = (),
                          new_group: Optional[Callable] = None,
                          timeout: Optional[Any] = None) -> ParallelState:
    """Create every process group of ``layout`` and return this rank's handle.

    ``torch.distributed.new_group`` must be called by all ranks for every group, in the same order,
    so every rank walks the full list. ``extra_group_ranks`` lists further groups, each as its ranks
    or as a :class:`GroupSpec` (every rank passes the same list; repeated entries collapse). ``new_group`` defaults to ``torch.distributed.new_group``.
    ``timeout`` (a ``datetime.timedelta``, from ``--distributed-timeout-minutes``) is given to every
    group: without it a subgroup gets torch's default (30 minutes for gloo, 10 for nccl) and a stalled
    peer hangs its collectives far longer than the user asked for.
    """
    if new_group is None:
        import torch.distributed as dist
        new_group = dist.new_group

    def make(groups: list[list[int]]):
        mine = None
        for ranks in groups:
            group = new_group(ranks=ranks, timeout=timeout)
            if rank in ranks:
                mine = group
        return mine if layout.world_size > 1 else None

    tensor_group = make(layout.all_groups("tp"))
    data_group = make(layout.all_groups("dp"))
    pipeline_group = make(layout.all_groups("pp"))
    extra = {}
    for key in dict.fromkeys(_group_key(entry) for entry in extra_group_ranks):
        group = new_group(ranks=list(key[1]), timeout=timeout)
        if rank in key[1]:
            extra[key] = group
    return ParallelState(layout=layout, rank=rank, tensor_group=tensor_group,
                         data_group=data_group, pipeline_group=pipeline_group,
                         backend=backend, extra_groups=extra)
