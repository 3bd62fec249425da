"""Crossover scheduling (Luo et al., arXiv 2103.07974): several jobs time-share the same ranks.

Each job is a whole ``pretrain`` run (its own config, model, optimizer, data, process groups, RNG
state, checkpoints and log) in its own thread. A :class:`Baton` lets exactly one job run at a time
and passes the turn in a fixed rotation at one point of every iteration: right after the job's
forward and backward passes, when its gradient reductions have been started but not waited for.
So while job A's gradients are being all-reduced, job B computes (crossover synchronisation):

    A.compute | B.compute ∥ A.sync | A.step, A.compute ∥ B.sync | B.step, B.compute ∥ A.sync | ...

Every rank runs the same rotation, so the collectives of each job line up across ranks, and each job
creates its own process groups, so they never mix (pipeline point-to-point messages travel on the
job's pipeline group). Before a job hands over the turn its RNG state is saved, and restored when
the turn comes back, so each job's numbers are bit-identical to running it alone
(``tests/distributed/test_crossover.py``). A job that finishes leaves the rotation.

The hand-off is on the critical path of every iteration (the next job computes only once it has the
turn), so it is kept small: the baton itself is a condition variable (a few microseconds between two
threads), and the RNG states are swapped as the generators' own objects (:class:`_GeneratorStates`,
about 0.1 ms; the checkpoint format of :func:`~megatron.training.checkpointing.capture_rng_state`,
which converts them to tensors and back, cost twice that).

Jobs file (``pretrain_gpt.py --crossover-config jobs.json``): JSON, ``{"jobs": [{"name": "a",
"args": "--num-layers 2 ..."}, ...]}`` where ``args`` is a string or a list of the job's flags.
JSON needs no extra dependency; every job's Megatron flags are written exactly as on a command line.
"""

from __future__ import annotations

import json
import random
import shlex
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class CrossoverJob:
    """One job: a name (prefix of its log lines) and its flags."""

    name: str
    args: tuple[str, ...]


def load_crossover_jobs(path: str) -> list[CrossoverJob]:
    """Read a jobs file (see the module docstring); errors name the file and the fix."""
    try:
        with open(path) as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"--crossover-config {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--crossover-config {path} is not valid JSON ({error}); expected "
                         f'{{"jobs": [{{"name": "a", "args": "--flags ..."}}, ...]}}') from None
    entries = document.get("jobs") if isinstance(document, dict) else None
    if not isinstance(entries, list) or len(entries) < 2:
        raise ValueError(f"--crossover-config {path} must list at least two jobs under \"jobs\"")
    jobs = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("args"), (str, list)):
            raise ValueError(f"--crossover-config {path}: job {index} needs a \"name\" string and "
                             f"an \"args\" string or list of flags")
        args = shlex.split(entry["args"]) if isinstance(entry["args"], str) else entry["args"]
        jobs.append(CrossoverJob(entry["name"], tuple(str(arg) for arg in args)))
    names = [job.name for job in jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"--crossover-config {path}: job names must be unique, got {names}")
    return jobs


class Baton:
    """Turn-taking between job threads: one runs at a time, in a fixed rotation."""

    def __init__(self, names: Sequence[str]):
        self._condition = threading.Condition()
        self._rotation = list(names)
        self._turn = self._rotation[0]

    def wait_for_turn(self, name: str) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._turn == name)

    def pass_turn(self, name: str) -> None:
        """Hand the turn to the next job in the rotation and wait until it comes back."""
        with self._condition:
            self._advance(name)
            self._condition.wait_for(lambda: self._turn == name)

    def leave(self, name: str) -> None:
        """``name`` is done (or failed): drop it from the rotation and hand over the turn."""
        with self._condition:
            if self._turn == name:
                self._advance(name)
            self._rotation.remove(name)
            self._condition.notify_all()

    def _advance(self, name: str) -> None:
        position = self._rotation.index(name)
        self._turn = self._rotation[(position + 1) % len(self._rotation)]
        self._condition.notify_all()


@dataclass(frozen=True)
class _GeneratorStates:
    """The global generators a job draws from (python, numpy, torch CPU and, once initialised, the
    current CUDA device), as the generators return them: an in-memory swap, not a checkpoint."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    cuda: Any

    @classmethod
    def capture(cls) -> "_GeneratorStates":
        cuda = torch.cuda.get_rng_state() \
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


class _JobTurns:
    """What a job calls between its compute and its sync: save its RNG, pass the turn, restore."""

    def __init__(self, baton: Baton, name: str):
        self.baton, self.name = baton, name

    def __call__(self) -> None:
        rng_state = _GeneratorStates.capture()
        self.baton.pass_turn(self.name)
        rng_state.restore()


def run_crossover(jobs: Sequence[CrossoverJob], run_job: Callable, log: Callable = print) -> dict:
    """Run ``run_job(job, after_compute, log)`` for every job under crossover scheduling.

    ``run_job`` builds and trains one job (``pretrain_gpt`` passes ``after_compute`` to
    :func:`~megatron.training.training.pretrain`) and returns its result. Returns ``{name:
    result}``; the first job error is re-raised after every thread has stopped.
    """
    baton = Baton([job.name for job in jobs])
    results, errors = {}, []

    def body(job: CrossoverJob) -> None:
        baton.wait_for_turn(job.name)
        try:
            results[job.name] = run_job(job, _JobTurns(baton, job.name),
                                        lambda text: log("\n".join(
                                            f"[{job.name}] {line}" for line in text.split("\n"))))
        except BaseException as error:  # reported by the main thread
            errors.append((job.name, error))
        finally:
            baton.leave(job.name)

    threads = [threading.Thread(target=body, args=(job,), name=f"crossover-{job.name}")
               for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        name, error = errors[0]
        raise RuntimeError(f"crossover job {name!r} failed: {type(error).__name__}: {error}") \
            from error
    return results
