"""The re-run engine (Megatron-LM's ``--rerun-mode validate_results``): tell a transient fault from a
persistent one by running a suspicious iteration a second time.

Each iteration's local results are validated before the optimizer steps (:class:`LocalResults`):

- the local losses (one per micro-batch whose loss this rank computed): NaN and infinite losses
  (fatal) always, a spiky loss (not fatal, at least ``SPIKY_LOSS_FACTOR`` times the largest of the
  first ``SPIKY_LOSS_SAMPLES`` losses) with ``--check-for-spiky-loss``;
- the norm of each bucket of this rank's own gradients just before the data-parallel reduction
  sends it (:mod:`megatron.training.gradient_checks`): NaN and infinite norms (fatal) with
  ``--check-for-nan-in-loss-and-grad``, unexpectedly large ones (not fatal, at least
  ``LARGE_GRADS_FACTOR`` times the largest of the first ``SPIKY_LOSS_SAMPLES`` norms) with
  ``--check-for-large-grads`` (Megatron's checks in its gradient buckets; re-runs compare them
  with a relative tolerance of ``GRADS_TOLERANCE``).

The first iteration of a job is not validated (Megatron's rule: a checkpoint may not be possible
before the optimizer has stepped once). Without the engine (``--rerun-mode disabled``) the
gradient checks still run (:func:`validate_without_rerun`): a fatal rejection stops the run
before the update, naming the rank and the bucket; a large norm is logged.

When any rank rejects a result, every rank (the decision is an all-reduce over the world, so every
schedule, Chimera included, re-runs together) restores the state the iteration started from (the
Python, NumPy, torch and CUDA generator states, the gradient reducers' state) and runs the
forward and backward passes again on the same micro-batches. At the validation that failed:

- the result differs (beyond ``TOLERANCE``): a transient fault. Fatal checks stop the run with
  ``EXIT_CODE_FAILED_ON_RESULT_VALIDATION`` (17) without saving ("resume from the last
  checkpoint"); a non-fatal one (spiky loss) continues with the re-run's gradients.
- the result is the same: a persistent fault or a correct result, which only a run on other
  hardware can tell apart. Fatal checks save a checkpoint (with ``--save``) and stop with
  ``EXIT_CODE_RESUME_TO_DISAMBIGUATE`` (16); a non-fatal one continues.

That checkpoint holds the iteration's starting state and the engine's (:attr:`RerunStop.
checkpoint_state`: what was rejected, on which node and device). The job resumed from it re-runs
the iteration once (:meth:`RerunEngine.resume_from_checkpoint`): on the same node and device it
stops with 16 again; elsewhere the rejecting rank compares, and the run stops with 17 naming
Megatron's verdict, "persistent error" (the result differs there) or "correct result" (it does not).

``--error-injection-rate N`` makes each validation reject its result with probability 1/N
(Megatron's draw: ``(randint(0, N - 1) + rank) % N == 0``, here from the engine's own generator
seeded with ``--seed``, so training's random streams are untouched), and ``--error-injection-type``
decides what the re-run finds: ``transient_error`` a different result, ``persistent_error`` and
``correct_result`` the same one. ``--result-rejected-tracker-filename`` appends one line per
rejected result in Megatron's format. A run without faults computes exactly what it computes
without the engine: the engine only reads the losses.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import socket
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, TypeVar

import torch

from megatron.training.determinism_stats import DeterminismReport

logger = logging.getLogger(__name__)

# Megatron-LM's exit codes (megatron/core/rerun_state_machine.py).
EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

SPIKY_LOSS_FACTOR = 10.0   # pretrain_gpt.py's SPIKY_LOSS_FACTOR
SPIKY_LOSS_SAMPLES = 100   # losses seen before a spike can be called
TOLERANCE = 0.0            # forward passes are deterministic: any difference is a fault
LARGE_GRADS_FACTOR = 10.0  # Megatron's threshold for "unexpected large grads"
GRADS_TOLERANCE = 0.001    # Megatron's tolerance for re-run gradient norms


MATCH = 0.0
MISMATCH = math.inf

Result = TypeVar("Result")


@dataclass(frozen=True)
class RerunStop:
    """The run must stop now: why, with which exit status, and whether to save first (then
    ``checkpoint_state``, this rank's :meth:`RerunEngine.resume_from_checkpoint` state, goes into
    the checkpoint)."""

    exit_code: int
    save_checkpoint: bool
    message: str
    checkpoint_state: Optional[dict] = None


def this_hardware() -> tuple[str, str]:
    """(node, device) this rank runs on: the SLURM node name (the host name outside SLURM) and the
    CUDA device index (``cpu`` without CUDA). Megatron's test for "re-run on the same GPU"."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return node, str(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Check:
    """One validation applied to every local result of one kind (``target``): ``loss`` (each
    local loss) or ``grads`` (each gradient bucket's local norm; ``{bucket}`` in the message is
    the bucket's number, in the order this rank's reductions sent them)."""

    message: str
    fatal: bool
    rejects: str  # "nan" | "inf" | "large"
    target: str = "loss"
    tolerance: float = TOLERANCE


NAN_CHECK = Check("found NaN in local forward loss calculation", fatal=True, rejects="nan")
INF_CHECK = Check("found Inf in local forward loss calculation", fatal=True, rejects="inf")
SPIKY_CHECK = Check("Spiky loss", fatal=False, rejects="large")
_BEFORE_REDUCTION = "in backward pass before data-parallel communication collective"
GRAD_NAN_CHECK = Check("found NaN in local grad norm for bucket #{bucket} " + _BEFORE_REDUCTION,
                       fatal=True, rejects="nan", target="grads", tolerance=GRADS_TOLERANCE)
GRAD_INF_CHECK = Check("found Inf in local grad norm for bucket #{bucket} " + _BEFORE_REDUCTION,
                       fatal=True, rejects="inf", target="grads", tolerance=GRADS_TOLERANCE)
LARGE_GRADS_CHECK = Check("found unexpected large grads in bucket #{bucket} " + _BEFORE_REDUCTION,
                          fatal=False, rejects="large", target="grads", tolerance=GRADS_TOLERANCE)


@dataclass(frozen=True)
class LocalResults:
    """What one run of an iteration produced on this rank that the checks look at."""

    losses: Sequence[float] = ()
    grad_norms: Sequence[float] = ()  # per gradient bucket, before its reduction

    def of(self, target: str) -> Sequence[float]:
        return self.losses if target == "loss" else self.grad_norms


def gradient_checks(training) -> tuple[Check, ...]:
    """The gradient checks the flags ask for (``config.training``)."""
    return (((GRAD_NAN_CHECK, GRAD_INF_CHECK) if training.check_for_nan_in_loss_and_grad else ())
            + ((LARGE_GRADS_CHECK,) if training.check_for_large_grads else ()))


@dataclass
class ResultValidator:
    """Applies checks to local results: every validation of a run in a fixed order, each named by
    its call (message, how many times that message was validated in this run), and the scale
    that "unexpectedly large" compares with, per target (Megatron's ``is_unexpectedly_large``:
    the first ``SPIKY_LOSS_SAMPLES`` finite values set it)."""

    checks: tuple[Check, ...]
    largest: dict = field(default_factory=dict)  # target -> the largest of its first samples
    samples: dict = field(default_factory=dict)  # target -> how many samples it has seen

    def validations(self, results: LocalResults):
        """(call, check, message, value) for every validation of ``results``, in order."""
        counts: dict[str, int] = {}
        for target in ("loss", "grads"):
            for index, value in enumerate(results.of(target)):
                for check in self.checks:
                    if check.target != target:
                        continue
                    message = check.message.format(bucket=index)
                    counts[message] = counts.get(message, 0) + 1
                    yield (message, counts[message]), check, message, value

    def value_at(self, results: LocalResults, call: tuple[str, int]) -> float:
        """The value ``results`` hold at validation ``call`` (NaN when they have none there)."""
        return next((value for at, _, _, value in self.validations(results) if at == call),
                    math.nan)

    def rejects(self, check: Check, value: float) -> bool:
        if check.rejects == "nan":
            return math.isnan(value)
        if check.rejects == "inf":
            return math.isinf(value)
        return self._is_unexpectedly_large(check.target, value)

    def _is_unexpectedly_large(self, target: str, value: float) -> bool:
        value = abs(value)
        if not math.isfinite(value):
            return False  # NaN and inf have checks of their own
        if self.samples.get(target, 0) < SPIKY_LOSS_SAMPLES:
            self.samples[target] = self.samples.get(target, 0) + 1
            self.largest[target] = max(self.largest.get(target, 0.0), value)
            return False
        factor = SPIKY_LOSS_FACTOR if target == "loss" else LARGE_GRADS_FACTOR
        return value >= self.largest[target] * factor


def validate_without_rerun(validator: ResultValidator, results: LocalResults, rank: int,
                           iteration: int) -> None:
    """``--rerun-mode disabled`` (Megatron's behaviour there): a rejected fatal check raises
    :class:`~megatron.training.iteration_health.TrainingDivergedError` before the update; a
    rejected non-fatal one is logged."""
    from megatron.training.iteration_health import TrainingDivergedError
    for _, check, message, value in validator.validations(results):
        if not validator.rejects(check, value):
            continue
        text = (f"rank {rank}: iteration {iteration}: unexpected result {value} "
                f"(message='{message}')")
        if check.fatal:
            raise TrainingDivergedError(
                f"{text}; the update was not applied. Lower the learning rate or "
                f"--init-method-std, resume from an earlier checkpoint, or run with --rerun-mode "
                f"validate_results to tell a hardware fault from a numerical one")
        logger.warning(text)


def relative_difference(initial: float, rerun: float) -> float:
    """Megatron's comparison: 0 for equal results (NaN equals NaN), inf when one is NaN or infinite
    and the other is not, else the relative difference."""
    if initial == rerun or (math.isnan(initial) and math.isnan(rerun)):
        return MATCH
    if math.isnan(initial) or math.isnan(rerun) or math.isinf(initial) or math.isinf(rerun):
        return MISMATCH
    return abs((initial - rerun) / (initial + rerun) * 2)


@dataclass
class ErrorInjector:
    """``--error-injection-rate`` / ``--error-injection-type``: rejects results on purpose and
    decides what the re-run of an injected error finds."""

    rate: int
    kind: str
    rank: int
    generator: random.Random
    injected: Optional[str] = None  # the kind of the injected error still being diagnosed

    def maybe_inject(self) -> bool:
        """Reject this validation's result? (At most one injection until it is diagnosed.)"""
        if self.rate <= 0 or self.injected is not None:
            return False
        if (self.generator.randint(0, self.rate - 1) + self.rank) % self.rate != 0:
            return False
        self.injected = self.kind
        logger.warning("rank %d: injecting an error of type %s", self.rank, self.kind)
        return True

    def compare_in_place(self, initial: float, rerun: float) -> float:
        """The comparison of the re-run on the same rank: an injected transient error differs, an
        injected persistent error or correct result matches; without injection, the real one."""
        if self.injected is None:
            return relative_difference(initial, rerun)
        kind, self.injected = self.injected, None
        return MISMATCH if kind == "transient_error" else MATCH


def world_any(device: torch.device) -> Callable[[Sequence[bool]], list[bool]]:
    """Each flag OR-ed over every rank of the world (one all-reduce; no-op in one process)."""
    from megatron.core.distributed import all_reduce_world

    def agree(flags: Sequence[bool]) -> list[bool]:
        tensor = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=device)
        all_reduce_world(tensor, op=torch.distributed.ReduceOp.MAX)
        return [bool(value > 0) for value in tensor.tolist()]
    return agree


@dataclass
class _Failure:
    """The first rejected validation of an iteration's initial run on this rank."""

    call: tuple[str, int]  # (check message, how many times that check ran before, + 1)
    check: Check
    initial: float
    injected: Optional[str] = None  # the kind of error injected there, if it was injected


@dataclass
class RerunEngine:
    """Validates each iteration's local results and re-runs a suspicious iteration (see the module
    docstring). The training loop owns one per run; ``run_iteration`` is its only hook."""

    rank: int
    validator: ResultValidator
    injector: ErrorInjector
    agree_any: Callable[[Sequence[bool]], list[bool]]
    save_state: Callable[[], object]
    restore_state: Callable[[object], None]
    tracker_filename: Optional[str] = None
    first_iteration_complete: bool = False
    determinism: Optional[DeterminismReport] = None  # --rerun-mode report_stats
    from_checkpoint: Optional[dict] = None  # a re-run on other hardware to do (see resume_...)

    @classmethod
    def from_config(cls, config, rank: int, device: torch.device,
                    save_state: Callable[[], object] = lambda: None,
                    restore_state: Callable[[object], None] = lambda state: None,
                    agree_any: Optional[Callable[[Sequence[bool]], list[bool]]] = None,
                    log: Callable[[str], None] = logger.info) -> Optional["RerunEngine"]:
        """The engine ``--rerun-mode`` asks for (None when disabled); ``log`` receives the
        determinism report of ``report_stats`` (global rank 0)."""
        training = config.training
        if training.rerun_mode == "disabled":
            return None
        if training.error_injection_rate < 0:
            raise ValueError(f"--error-injection-rate {training.error_injection_rate} must be >= 0 "
                             f"(one injected error per N validations; 0 injects none)")
        checks = ((NAN_CHECK, INF_CHECK) + ((SPIKY_CHECK,) if training.check_for_spiky_loss
                                            else ()) + gradient_checks(training))
        injector = ErrorInjector(rate=training.error_injection_rate,
                                 kind=training.error_injection_type, rank=rank,
                                 generator=random.Random(training.seed))
        tracker = training.result_rejected_tracker_filename
        if tracker is not None:
            try:
                with open(tracker, "a"):
                    pass
            except OSError as error:
                raise ValueError(f"--result-rejected-tracker-filename {tracker}: cannot append to "
                                 f"it ({error}); give a writable file") from None
        determinism = (DeterminismReport(log) if training.rerun_mode == "report_stats"
                       else None)
        return cls(rank=rank, validator=ResultValidator(checks), injector=injector,
                   determinism=determinism,
                   agree_any=agree_any or world_any(device), save_state=save_state,
                   restore_state=restore_state, tracker_filename=tracker)

    # ------------------------------------------------------------------------------- the hook

    def run_iteration(self, iteration: int, compute: Callable[[], Result],
                      local_results: Callable[[Result], LocalResults]
                      ) -> tuple[Result, Optional[RerunStop]]:
        """Run ``compute`` (zero the gradients, forward and backward, wait for the reductions) for
        iteration ``iteration`` (1-based), validate its ``local_results`` and re-run it when any
        rank rejected a result. Returns the result to step with, and a stop when the run must end
        before the optimizer step (the same on every rank)."""
        if self.determinism is not None:
            return self._run_twice_for_stats(iteration, compute, local_results), None
        if self.from_checkpoint is not None:
            pending, self.from_checkpoint = self.from_checkpoint, None
            if pending["iteration"] == iteration:
                return self._rerun_from_checkpoint(iteration, pending, compute, local_results)
            logger.warning("rank %d: the checkpoint asked to re-run iteration %d, but the run "
                           "resumes at iteration %d: no diagnosis", self.rank,
                           pending["iteration"], iteration)
        saved = self.save_state()
        result = compute()
        failure = self._validate_initial(iteration, local_results(result))
        self.first_iteration_complete = True
        if not self.agree_any([failure is not None])[0]:
            return result, None
        if self.rank == 0:
            logger.warning("iteration %d: re-running the iteration to check whether the "
                           "rejected result reproduces", iteration)
        self.restore_state(saved)
        result = compute()
        reproduced = None if failure is None else \
            self._compare(iteration, failure, local_results(result))
        fatal_reproduced = failure is not None and failure.check.fatal and bool(reproduced)
        fatal_transient = failure is not None and failure.check.fatal and reproduced is False
        will_checkpoint, will_fail = self.agree_any([fatal_reproduced, fatal_transient])
        if will_checkpoint:
            self.restore_state(saved)  # the checkpoint resumes from the iteration's start
            return result, RerunStop(
                EXIT_CODE_RESUME_TO_DISAMBIGUATE, save_checkpoint=True,
                message=f"iteration {iteration}: a rejected result reproduced when the iteration "
                        f"was re-run on the same rank: a persistent fault or a correct result. "
                        f"Saving a checkpoint and exiting (status "
                        f"{EXIT_CODE_RESUME_TO_DISAMBIGUATE}); resume from it on other GPUs to "
                        f"re-run the iteration there",
                checkpoint_state=self._checkpoint_state(iteration, failure))
        if will_fail:
            return result, RerunStop(
                EXIT_CODE_FAILED_ON_RESULT_VALIDATION, save_checkpoint=False,
                message=f"iteration {iteration}: a rejected result did not reproduce when the "
                        f"iteration was re-run on the same rank: a transient fault. Exiting "
                        f"(status {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}) without saving; "
                        f"resume from the last checkpoint")
        if self.rank == 0:
            logger.warning("iteration %d: continuing with the re-run's result (the rejected "
                           "result's check is not fatal)", iteration)
        return result, None

    def resume_from_checkpoint(self, state: dict) -> None:
        """A checkpoint saved at exit 16 holds, per rank, the iteration to re-run and (on a rank
        that rejected a result) what it rejected and on which node and device: the next
        :meth:`run_iteration` of that iteration runs it once, compares there and ends the
        diagnosis (Megatron's second re-run, on other hardware)."""
        self.from_checkpoint = dict(state)

    # ------------------------------------------------------------------------------ internals

    def _run_twice_for_stats(self, iteration: int, compute: Callable[[], Result],
                             local_results: Callable[[Result], LocalResults]) -> Result:
        """``report_stats``: run the iteration, restore its starting state, run it again; record
        the relative difference at every validation; continue with the second run (Megatron)."""
        saved = self.save_state()
        first = local_results(compute())
        self.restore_state(saved)
        result = compute()
        second = {call: value for call, _, _, value in
                  self.validator.validations(local_results(result))}
        assert self.determinism is not None
        for call, _, message, value in self.validator.validations(first):
            self.determinism.record(message,
                                    relative_difference(value, second.get(call, math.nan)))
        self.determinism.report_if_due(iteration)
        return result

    def _checkpoint_state(self, iteration: int, failure: Optional[_Failure]) -> dict:
        node, device = this_hardware()
        described = None if failure is None else {
            "message": failure.call[0], "invocation": failure.call[1],
            "initial": failure.initial, "fatal": failure.check.fatal,
            "tolerance": failure.check.tolerance, "injected": failure.injected}
        return {"iteration": iteration, "node": node, "device": device, "failure": described}

    def _rerun_from_checkpoint(self, iteration: int, pending: dict, compute: Callable[[], Result],
                               local_results: Callable[[Result], LocalResults]
                               ) -> tuple[Result, Optional[RerunStop]]:
        """Megatron's second re-run: the iteration that reproduced a rejected result on its own
        rank runs once more, from the checkpoint; the rank that rejected it compares (unless it
        landed on the same node and device again)."""
        result = compute()
        self.first_iteration_complete = True
        same_hardware = persistent = correct = False
        failure = pending.get("failure")
        if failure is not None:
            message = failure["message"]
            if this_hardware() == (pending["node"], pending["device"]):
                same_hardware = True
                logger.error("rank %d: iteration %d: re-running on the node and device that "
                             "rejected the result (%s, %s); only other hardware can tell a "
                             "persistent fault from a correct result", self.rank, iteration,
                             pending["node"], pending["device"])
            else:
                rerun = self.validator.value_at(local_results(result),
                                                (message, failure["invocation"]))
                injected = failure.get("injected")
                difference = (relative_difference(failure["initial"], rerun) if injected is None
                              else MISMATCH if injected == "persistent_error" else MATCH)
                reproduced = difference <= failure["tolerance"]
                self._track(iteration, "second_rerun_reproducible" if reproduced
                            else "second_rerun_not_reproducible", rerun, message)
                logger.error("rank %d: iteration %d: second re-run on other hardware: %s (%s %s "
                             "%s, message='%s')", self.rank, iteration,
                             "the result reproduces: it was likely correct (an application or "
                             "data problem)" if reproduced else "the result does not reproduce: "
                             "possible persistent fault of the first hardware", rerun,
                             "=" if reproduced else "!=", failure["initial"], message)
                if failure["fatal"]:
                    correct, persistent = reproduced, not reproduced
        same_hardware, persistent, correct = self.agree_any([same_hardware, persistent, correct])
        where = f"iteration {iteration} re-run from the checkpoint"
        if same_hardware:
            return result, RerunStop(
                EXIT_CODE_RESUME_TO_DISAMBIGUATE, save_checkpoint=False,
                message=f"{where} landed on the node and device that rejected its result; "
                        f"exiting (status {EXIT_CODE_RESUME_TO_DISAMBIGUATE}): resume again from "
                        f"the same checkpoint on other hardware")
        if persistent:
            return result, RerunStop(
                EXIT_CODE_FAILED_ON_RESULT_VALIDATION, save_checkpoint=False,
                message=f"{where}: the rejected result does not reproduce on other hardware: a "
                        f"persistent fault of the node that produced it (Megatron's "
                        f"'persistent error'). Exiting (status "
                        f"{EXIT_CODE_FAILED_ON_RESULT_VALIDATION}); leave that node out and "
                        f"resume from the same checkpoint")
        if correct:
            return result, RerunStop(
                EXIT_CODE_FAILED_ON_RESULT_VALIDATION, save_checkpoint=False,
                message=f"{where}: the rejected result reproduces on other hardware: it is what "
                        f"the model computes on this data (Megatron's 'correct result'), not a "
                        f"hardware fault. Exiting (status {EXIT_CODE_FAILED_ON_RESULT_VALIDATION}); "
                        f"skip its data (--iterations-to-skip {iteration - 1}) or lower the "
                        f"learning rate before resuming")
        return result, None

    def _validate_initial(self, iteration: int, results: LocalResults) -> Optional[_Failure]:
        """The first rejected validation of the initial run (None: all accepted)."""
        if not self.first_iteration_complete:
            return None
        for call, check, message, value in self.validator.validations(results):
            if self.injector.maybe_inject() or self.validator.rejects(check, value):
                self._track(iteration, "initial_run", value, message)
                logger.error("rank %d: iteration %d: unexpected result %s (invocation #%d, "
                             "message='%s')", self.rank, iteration, value, call[1], message)
                return _Failure(call, check, value)
        return None

    def _compare(self, iteration: int, failure: _Failure, results: LocalResults) -> bool:
        """Does the re-run reproduce the rejected result? (Looked up at the same validation.)"""
        rerun = self.validator.value_at(results, failure.call)
        failure.injected = self.injector.injected
        reproduced = (self.injector.compare_in_place(failure.initial, rerun)
                      <= failure.check.tolerance)
        message = failure.call[0]
        status = "first_rerun_reproducible" if reproduced else "first_rerun_not_reproducible"
        self._track(iteration, status, rerun, message)
        level = logging.ERROR if failure.check.fatal else logging.WARNING
        verdict = ("reproducible: a persistent fault or a correct result; only other hardware "
                   "can tell" if reproduced else "not reproducible: possible transient error")
        logger.log(level, "rank %d: iteration %d: re-run: the unexpected result is %s (%s %s "
                          "%s, message='%s')", self.rank, iteration, verdict, rerun,
                   "=" if reproduced else "!=", failure.initial, message)
        return reproduced

    def _track(self, iteration: int, status: str, result: float, message: str) -> None:
        """One line of --result-rejected-tracker-filename, in Megatron's format."""
        if self.tracker_filename is None:
            return
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        with open(self.tracker_filename, "a") as tracker:
            tracker.write(f"ts={datetime.datetime.now()} node={socket.gethostname()} "
                          f"device={device} jobID={os.getenv('SLURM_JOBID', 'N/A')} "
                          f"rank={self.rank} iteration={iteration} status={status} "
                          f"result={result} message='{message}'\n")
