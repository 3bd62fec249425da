"""The gradient-reduction seam: what a data-parallel gradient reduction does, and its lifecycle.

A *gradient reduction* owns the gradients of some parameters and makes them equal to the sum
(divided by ``divide_by``) over the ranks of one process group. The per-iteration part:

* ``start()`` launches the reduction without blocking (the schedule decides when);
* ``start_when_ready()`` optionally arms a launch from inside the next backward (overlap);
* ``wait()`` completes it (starting it first if nobody did); ``started`` says whether it is in flight
  (``issued``: whether all its collectives are launched, which an armed overlap can reach first);
* ``zero_grad()`` clears the gradients for the next iteration.

The lifecycle, called by the training loop and the checkpointer (no-ops by default, so a plain
all-reduce implements none of them):

* ``attach(optimizer)`` once, after the optimizer exists (e.g. to read its loss scale or state);
* ``after_step(ok)`` after every optimizer step (``ok``: the update was applied, no overflow);
* ``synchronize()`` makes the replicas exactly equal (collective; the same order on every rank)
  before every evaluation and checkpoint; ``synchronize_periodically()`` is the sync every
  ``sync_interval`` iterations (by default the same; a reduction may average less there);
* ``state_dict()`` / ``load_state_dict(state)``: what a checkpoint keeps (when ``has_state``);
* ``watch_local_gradients(observer)``: ``observer(tensor)`` is then called with each bucket of this
  rank's own gradients just before the reduction communicates it (Megatron's per-bucket checks,
  ``--check-for-large-grads``; :mod:`megatron.training.gradient_checks`). The exact reductions
  call it; the compressing ones watch the exact reduction they wrap; by default nobody is called.

Declared attributes say what a reduction is, instead of callers probing for methods:

* ``shards_gradients``: it reduce-scatters and exposes ``shards`` (and ``params``,
  ``shard_ranges()``, ``stage_id``, ``group``, ``start_parameter_gather()``) for a distributed
  optimizer (:class:`~.sharded_reducer.ShardedGradientReducer`);
* ``has_state``: ``state_dict()`` holds something a checkpoint must keep (per data-parallel rank);
* ``sync_interval``: call ``synchronize()`` every this many iterations (0: never).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional


class GradientReduction:
    """The seam (see the module docstring). Implementations subclass it and override the
    per-iteration methods; the lifecycle methods and declared attributes have safe defaults."""

    shards_gradients: bool = False
    has_state: bool = False
    sync_interval: int = 0
    local_gradients_observer: Optional[Callable[[Any], None]] = None

    def watch_local_gradients(self, observer: Optional[Callable[[Any], None]]) -> None:
        """Call ``observer`` with each bucket of local gradients before it is communicated (None:
        stop). Reductions that never call :meth:`observe_local_gradients` watch nothing."""
        self.local_gradients_observer = observer

    def observe_local_gradients(self, gradients: Any) -> None:
        """Implementations call this with a bucket's local gradients right before sending it."""
        if self.local_gradients_observer is not None:
            self.local_gradients_observer(gradients)

    @property
    def started(self) -> bool:
        raise NotImplementedError

    @property
    def issued(self) -> bool:
        """Every collective of this iteration's reduction has been launched (by default: once
        started). The pipeline interpreter arms a later module's overlap only after the earlier
        modules' reductions are issued, so every rank launches its groups' collectives in the
        schedule's one sync order."""
        return self.started

    def start_when_ready(self) -> None:
        """Arm a launch during the next backward; by default the reduction waits for start()."""

    def start(self) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------------- the lifecycle

    def attach(self, optimizer: Any) -> None:
        """Called once with the run's :class:`~megatron.core.optimizer.MegatronOptimizer`."""

    def after_step(self, ok: bool) -> None:
        """Called after every optimizer step; ``ok`` is False when the update was skipped."""

    def synchronize(self) -> None:
        """Make the replicas exactly equal (collective); nothing to do for exact reductions."""

    def synchronize_periodically(self) -> None:
        """The sync every ``sync_interval`` iterations (collective); :meth:`synchronize` unless a
        reduction averages less there."""
        self.synchronize()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (only called when ``has_state``)."""


# ------------------------------------------------------------- the lifecycle over a rank's reducers

def attach_reducers(reducers: Iterable[GradientReduction], optimizer: Any) -> None:
    for reducer in reducers:
        reducer.attach(optimizer)


def after_step(reducers: Iterable[GradientReduction], ok: bool) -> None:
    for reducer in reducers:
        reducer.after_step(ok)


def synchronize_reducers(reducers: Iterable[GradientReduction]) -> None:
    """Every reduction's exact replica synchronisation, in the same order on every rank."""
    for reducer in reducers:
        reducer.synchronize()


def synchronize_if_due(reducers: Iterable[GradientReduction], iteration: int) -> None:
    """The periodic synchronisation of the reductions whose ``sync_interval`` divides
    ``iteration`` (the number of iterations done)."""
    for reducer in reducers:
        if reducer.sync_interval > 0 and iteration % reducer.sync_interval == 0:
            reducer.synchronize_periodically()


def reducer_states(reducers: Iterable[GradientReduction]) -> Optional[list]:
    """This rank's state of every reduction with ``has_state`` (in order), or None without any."""
    states = [reducer.state_dict() for reducer in reducers if reducer.has_state]
    return states or None


def load_reducer_states(reducers: Iterable[GradientReduction], states: Optional[list],
                        dp_rank: int) -> None:
    """Restore this data-parallel rank's reduction states from a checkpoint's per-rank list (each
    entry a :func:`reducer_states` list). Nothing to do when no reduction has state or the
    checkpoint holds none."""
    stateful = [reducer for reducer in reducers if reducer.has_state]
    if not stateful or not states:
        return
    if len(states) <= dp_rank or states[dp_rank] is None:
        raise ValueError("the checkpoint holds no gradient-reducer state (e.g. A2SGD error "
                         f"buffers) for data-parallel rank {dp_rank}; resume with the "
                         "data-parallel size it was saved with, or pass --no-load-optim")
    if len(states[dp_rank]) != len(stateful):
        raise ValueError(f"the checkpoint holds the state of {len(states[dp_rank])} gradient "
                         f"reducer(s) for data-parallel rank {dp_rank}, but this run has "
                         f"{len(stateful)}; resume with the same model, parallel layout and "
                         "--dp-gradient-reducer, or pass --no-load-optim")
    for reducer, state in zip(stateful, states[dp_rank]):
        reducer.load_state_dict(state)


# -------------------------------------------------- the table --dp-gradient-reducer chooses from

@dataclass(frozen=True)
class ChunkReductionRequest:
    """What a reducer kind's factory gets to build the reduction of one model chunk.

    ``params``: the chunk's trainable parameters to reduce; ``key``: its module key (a
    (pipeline, stage) ``ModuleKey`` or a chunk index); ``replica_group``: the group over every copy of
    the chunk (the data-parallel group without a pipeline); ``divide_by``: the data-parallel size;
    ``data_group``: the data-parallel group; ``direction_group()``: this data-parallel replica's
    group over its copies of the stage (None without several pipeline directions; only built when
    the kind ``needs_direction_groups``); ``tensor_parallel``: tensor parallelism is on;
    ``parallel``: the run's ``ParallelConfig`` (None in library use); ``sharded``: the distributed
    optimizer steps shards (``--use-distributed-optimizer``); ``bucket_size`` / ``overlap``: as
    for :class:`~.gradient_reducer.GradientReducer` (already False unless the kind ``overlaps``).
    """

    params: list
    key: Hashable
    replica_group: Any
    divide_by: float
    data_group: Any = None
    direction_group: Callable[[], Any] = lambda: None
    tensor_parallel: bool = False
    parallel: Any = None
    sharded: bool = False
    bucket_size: Optional[int] = None
    overlap: bool = False


def _no_checks(parallel_config) -> None:
    """A kind without flag rules of its own."""


@dataclass(frozen=True)
class ReducerKind:
    """One ``--dp-gradient-reducer`` choice: its factory and what the runtimes must prepare.

    ``build(request)`` -> the :class:`GradientReduction` of one chunk; ``needs_direction_groups``:
    the pipeline runtime creates the per-replica direction groups of ``request.direction_group``;
    ``overlaps``: it honours ``--overlap-grad-reduce``; ``validate(parallel_config)`` raises a
    ``ValueError`` naming a flag combination the kind refuses.
    """

    name: str
    description: str
    build: Callable[[ChunkReductionRequest], GradientReduction]
    needs_direction_groups: bool = False
    overlaps: bool = True
    validate: Callable[[Any], None] = _no_checks


@dataclass(frozen=True)
class ReducerTable:
    """The reducer kinds a runtime can build, by name (an immutable value: :meth:`with_kind`
    returns a new table, so a test can add a kind without changing anybody else's)."""

    kinds: tuple = ()

    @property
    def names(self) -> tuple:
        return tuple(kind.name for kind in self.kinds)

    def with_kind(self, kind: ReducerKind) -> "ReducerTable":
        if kind.name in self.names:
            raise ValueError(f"gradient reducer {kind.name!r} is already in the table; give the "
                             f"new kind another name")
        return ReducerTable(self.kinds + (kind,))

    def get(self, name: str) -> ReducerKind:
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise ValueError(f"unknown gradient reducer {name!r} (--dp-gradient-reducer); this "
                         f"runtime's table has {', '.join(self.names)}")
