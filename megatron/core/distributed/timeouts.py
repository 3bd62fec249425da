"""Say which group and which peer a rank was waiting for when a wait on other ranks times out.

Every process group is created with ``--distributed-timeout-minutes`` (see
:func:`megatron.core.parallel_state.create_parallel_state`), so a stalled or dead peer ends the
wait with the backend's error, e.g. gloo's ``Timed out waiting 60000ms for recv operation to
complete``: it names the timeout and the operation but not the group or the rank that did not
answer. Code that waits wraps the wait in :func:`awaiting` with a description of what it waits for;
a timeout then becomes a :class:`CommunicationTimeout` whose message starts with this rank, the
awaited operation, the group (its global ranks) and the peer(s), and keeps the backend's message.

Descriptions nest: the innermost wrapper names the wait most precisely, and outer wrappers (e.g. the
training step's fallback naming every group of the rank) leave an already named timeout alone.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch.distributed as dist

# gloo: "Timed out waiting 60000ms for recv operation"; store: "wait timeout after 60000ms";
# NCCL watchdog: "... ran for 600000 milliseconds before timing out".
_TIMEOUT_PATTERN = re.compile(r"timed out|timeout|timing out", re.IGNORECASE)


class CommunicationTimeout(RuntimeError):
    """A wait on other ranks passed ``--distributed-timeout-minutes``; the message names the wait,
    the group and the peer(s) that did not answer."""


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a backend's timeout (by its message: backends raise RuntimeError
    subclasses without a dedicated type for timeouts)."""
    return isinstance(error, RuntimeError) and bool(_TIMEOUT_PATTERN.search(str(error)))


def _already_named(error: Optional[BaseException]) -> bool:
    """Whether ``error`` or an error it was raised from is a :class:`CommunicationTimeout`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, CommunicationTimeout):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def group_ranks(group: Any) -> Optional[list[int]]:
    """The global ranks of ``group`` (None when unknown: no group, or no running process group)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return None


def describe_group(name: str, group: Any, peers: Optional[Iterable[int]] = None) -> str:
    """``the <name> group (global ranks [...])``, plus the peers awaited (default: every other
    member of the group, any of which may be the one that did not arrive)."""
    ranks = group_ranks(group)
    if ranks is None:
        return f"the {name} group"
    me = dist.get_rank()
    peers = [rank for rank in ranks if rank != me] if peers is None else list(peers)
    return f"the {name} group (global ranks {ranks}), waiting for global rank(s) {peers}"


def _this_rank() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()}"
    return "this process"


def named_timeout(error: BaseException,
                  what: Union[str, Callable[[], str]]) -> Optional["CommunicationTimeout"]:
    """The :class:`CommunicationTimeout` naming ``what`` that ``error`` should be re-raised as
    (``raise named from error``), or None when ``error`` is not a backend timeout or is already
    named. :func:`awaiting` in a function, for hot paths that catch the error themselves (a
    generator-based context manager costs microseconds on every wait)."""
    if _already_named(error) or not is_timeout(error):
        return None
    what = what() if callable(what) else what
    backend_message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return CommunicationTimeout(
        f"{_this_rank()}: timed out waiting for {what}. That peer did not answer within "
        f"--distributed-timeout-minutes: it is stalled (stopped, swapping, stuck in another "
        f"collective) or dead; look at its log. Backend error: {backend_message}")


@contextmanager
def awaiting(what: Union[str, Callable[[], str]]) -> Iterator[None]:
    """Turn a backend timeout raised inside the block into a :class:`CommunicationTimeout` naming
    ``what`` (the operation, the group and the peer; see :func:`describe_group`). ``what`` may be a
    function returning the text, so that hot paths only build it when a timeout happens."""
    try:
        yield
    except RuntimeError as error:
        named = named_timeout(error, what)
        if named is None:
            raise
        raise named from error
