"""Tier 0: the re-run engine's decisions (megatron/training/rerun.py) on real and injected faults,
with a scripted iteration instead of a model (no process, no collective)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from megatron.training.determinism_stats import DeterminismStats
from megatron.training.iteration_health import TrainingDivergedError
from megatron.training.rerun import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                     EXIT_CODE_RESUME_TO_DISAMBIGUATE, LARGE_GRADS_FACTOR,
                                     SPIKY_LOSS_FACTOR, SPIKY_LOSS_SAMPLES, ErrorInjector,
                                     LocalResults, RerunEngine, ResultValidator, gradient_checks,
                                     relative_difference, this_hardware,
                                     validate_without_rerun)


def _config(mode="validate_results", spiky=False, rate=0, kind="transient_error", tracker=None,
            nan_grads=False, large_grads=False):
    return SimpleNamespace(training=SimpleNamespace(
        rerun_mode=mode, check_for_spiky_loss=spiky, error_injection_rate=rate,
        error_injection_type=kind, result_rejected_tracker_filename=tracker, seed=1234,
        check_for_nan_in_loss_and_grad=nan_grads, check_for_large_grads=large_grads))


class Script:
    """The passes of each iteration: a list of loss lists, one per run of the iteration, and a
    record of every state saved and restored."""

    def __init__(self):
        self.runs: list[list[float]] = []
        self.calls = 0
        self.restored: list[object] = []
        self.saved = 0

    def engine(self, config=None, agree_any=None, rank=0):
        def save_state():
            self.saved += 1
            return ("state", self.saved)
        engine = RerunEngine.from_config(config or _config(), rank, device=None,
                                         save_state=save_state,
                                         restore_state=self.restored.append,
                                         agree_any=agree_any or (lambda flags: list(flags)))
        assert engine is not None
        return engine

    def iteration(self, engine, iteration, *runs):
        """Runs are loss lists, or LocalResults (losses and gradient-bucket norms)."""
        self.runs, self.calls = list(runs), 0

        def compute():
            self.calls += 1
            return self.runs[min(self.calls, len(self.runs)) - 1]

        def local_results(run):
            return run if isinstance(run, LocalResults) else LocalResults(losses=list(run))
        return engine.run_iteration(iteration, compute, local_results)


def test_disabled_mode_builds_no_engine():
    assert RerunEngine.from_config(_config(mode="disabled"), 0, device=None) is None


def test_results_without_faults_run_once_and_continue():
    script = Script()
    engine = script.engine()
    for iteration in (1, 2, 3):
        result, stop = script.iteration(engine, iteration, [2.5, 2.4])
        assert (result, stop, script.calls) == ([2.5, 2.4], None, 1)
    assert script.restored == []


def test_the_first_iteration_of_a_job_is_not_validated():
    script = Script()
    result, stop = script.iteration(script.engine(), 1, [math.nan])
    assert stop is None and script.calls == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_reproducible_fatal_result_saves_and_exits_16(bad):
    script = Script()
    engine = script.engine()
    script.iteration(engine, 1, [2.0])
    result, stop = script.iteration(engine, 2, [2.0, bad], [2.0, bad])
    # the iteration's own state, before the re-run and again before the checkpoint is saved
    assert script.calls == 2 and script.restored == [("state", 2), ("state", 2)]
    assert stop.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE and stop.save_checkpoint
    assert "reproduced" in stop.message and "iteration 2" in stop.message


def test_a_fatal_result_that_does_not_reproduce_is_transient_and_exits_17():
    script = Script()
    engine = script.engine()
    script.iteration(engine, 1, [2.0])
    result, stop = script.iteration(engine, 2, [math.nan, 2.0], [2.1, 2.0])
    assert script.calls == 2
    assert stop.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION and not stop.save_checkpoint
    assert "transient" in stop.message


@pytest.mark.parametrize("kind, code", [("transient_error", EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
                                        ("persistent_error", EXIT_CODE_RESUME_TO_DISAMBIGUATE),
                                        ("correct_result", EXIT_CODE_RESUME_TO_DISAMBIGUATE)])
def test_injected_errors_are_diagnosed_by_their_type(kind, code):
    script = Script()
    engine = script.engine(_config(rate=1, kind=kind))
    assert script.iteration(engine, 1, [2.0]) == ([2.0], None)  # never in the first iteration
    result, stop = script.iteration(engine, 2, [2.0], [2.0])
    assert script.calls == 2 and stop.exit_code == code


def test_a_spiky_loss_is_rerun_and_training_continues_with_the_rerun():
    script = Script()
    engine = script.engine(_config(spiky=True))
    script.iteration(engine, 1, [2.0])
    for iteration in range(2, 2 + SPIKY_LOSS_SAMPLES):
        assert script.iteration(engine, iteration, [2.0])[1] is None
    assert script.calls == 1
    spike = 2.0 * SPIKY_LOSS_FACTOR
    result, stop = script.iteration(engine, 200, [spike], [spike + 1])
    assert stop is None and result == [spike + 1] and script.calls == 2
    assert script.iteration(engine, 201, [spike * 0.99])[1] is None  # below the factor


def test_every_rank_reruns_when_another_rank_rejected_a_result():
    """This rank saw nothing wrong; the world's vote (another rank's NaN) makes it re-run, and the
    second vote (that rank's verdict) makes it stop with the same status."""
    votes = iter([[True], [True, False]])
    script = Script()
    engine = script.engine(agree_any=lambda flags: next(votes))
    engine.first_iteration_complete = True
    result, stop = script.iteration(engine, 5, [2.0], [2.0])
    assert script.calls == 2 and stop.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE


def test_the_tracker_file_gets_megatron_lines(tmp_path):
    tracker = tmp_path / "rejected.txt"
    script = Script()
    engine = script.engine(_config(tracker=str(tracker)), rank=3)
    script.iteration(engine, 1, [2.0])
    script.iteration(engine, 2, [math.nan], [math.nan])
    lines = tracker.read_text().splitlines()
    assert len(lines) == 2
    assert "rank=3 iteration=2 status=initial_run result=nan" in lines[0]
    assert "status=first_rerun_reproducible" in lines[1]
    assert lines[0].startswith("ts=") and "message='found NaN in local forward loss" in lines[0]


def test_an_unwritable_tracker_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--result-rejected-tracker-filename"):
        RerunEngine.from_config(_config(tracker=str(tmp_path / "missing" / "f")), 0, None)


def test_a_negative_injection_rate_is_refused():
    with pytest.raises(ValueError, match="--error-injection-rate -1 must be >= 0"):
        RerunEngine.from_config(_config(rate=-1), 0, None)


def test_injection_draws_megatrons_rank_offset():
    """(randint(0, N-1) + rank) % N == 0: with one shared draw, exactly one rank in N injects."""
    hits = [ErrorInjector(4, "transient_error", rank, random.Random(9)).maybe_inject()
            for rank in range(4)]
    assert sum(hits) == 1


def test_megatrons_comparison():
    assert relative_difference(2.0, 2.0) == 0.0
    assert relative_difference(math.nan, math.nan) == 0.0
    assert relative_difference(math.nan, 2.0) == math.inf
    assert relative_difference(math.inf, 2.0) == math.inf
    assert relative_difference(2.0, 2.2) == pytest.approx(0.2 / 2.1)


# ------------------------------------------------------------------ per-bucket gradient checks

def _grads(*norms, losses=(2.0,)):
    return LocalResults(losses=losses, grad_norms=norms)


def test_gradient_checks_follow_the_flags():
    assert gradient_checks(_config().training) == ()
    assert [c.rejects for c in gradient_checks(_config(nan_grads=True).training)] == ["nan", "inf"]
    assert [c.rejects for c in gradient_checks(_config(large_grads=True).training)] == ["large"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_bucket_is_rejected_before_the_reduction(bad, tmp_path):
    tracker = tmp_path / "rejected.txt"
    script = Script()
    engine = script.engine(_config(nan_grads=True, tracker=str(tracker)))
    script.iteration(engine, 1, _grads(1.0, 2.0))
    result, stop = script.iteration(engine, 2, _grads(1.0, bad), _grads(1.0, bad))
    assert script.calls == 2 and stop.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE
    kind = "NaN" if math.isnan(bad) else "Inf"
    assert (f"message='found {kind} in local grad norm for bucket #1 in backward pass before "
            f"data-parallel communication collective'") in tracker.read_text()


@pytest.mark.parametrize("rerun_norm, status", [(30.01, "first_rerun_reproducible"),
                                                (30.1, "first_rerun_not_reproducible")])
def test_a_gradient_norm_within_megatrons_tolerance_counts_as_reproduced(rerun_norm, status,
                                                                         tmp_path):
    """Gradient norms are compared with Megatron's relative tolerance 0.001 (losses exactly)."""
    tracker = tmp_path / "rejected.txt"
    script = Script()
    engine = script.engine(_config(large_grads=True, tracker=str(tracker)))
    script.iteration(engine, 1, _grads(3.0))
    for iteration in range(2, 2 + SPIKY_LOSS_SAMPLES):
        script.iteration(engine, iteration, _grads(3.0))
    _, stop = script.iteration(engine, 200, _grads(30.0), _grads(rerun_norm))
    assert stop is None
    assert f"status={status} result={rerun_norm}" in tracker.read_text()


def test_large_grads_are_rerun_then_training_continues():
    script = Script()
    engine = script.engine(_config(large_grads=True))
    script.iteration(engine, 1, _grads(3.0))
    for iteration in range(2, 2 + SPIKY_LOSS_SAMPLES):
        assert script.iteration(engine, iteration, _grads(3.0))[1] is None
    assert script.calls == 1
    large = _grads(3.0 * LARGE_GRADS_FACTOR)
    result, stop = script.iteration(engine, 200, large, large)
    assert stop is None and script.calls == 2  # re-run, reproducible, not fatal: continue
    assert script.iteration(engine, 201, _grads(3.0 * LARGE_GRADS_FACTOR * 0.99))[1] is None


def test_loss_and_gradient_scales_are_kept_apart():
    """A loss of 2 and gradient norms of 1000: neither makes the other look large."""
    validator = ResultValidator(gradient_checks(_config(large_grads=True).training)
                                + tuple(c for c in RerunEngine.from_config(
                                    _config(spiky=True), 0, None).validator.checks))
    for _ in range(SPIKY_LOSS_SAMPLES):
        for _, check, _, value in validator.validations(_grads(1000.0, losses=(2.0,))):
            assert not validator.rejects(check, value)
    rejected = [message for _, check, message, value in
                validator.validations(_grads(1000.0, losses=(25.0,)))
                if validator.rejects(check, value)]
    assert rejected == ["Spiky loss"]


def test_without_the_engine_a_bad_bucket_stops_the_run_and_a_large_one_is_logged(caplog):
    validator = ResultValidator(gradient_checks(_config(nan_grads=True, large_grads=True).training))
    for _ in range(SPIKY_LOSS_SAMPLES):
        validate_without_rerun(validator, _grads(1.0, 1.0), rank=2, iteration=5)
    validate_without_rerun(validator, _grads(1.0, 50.0), rank=2, iteration=6)
    assert "found unexpected large grads in bucket #1" in caplog.text
    with pytest.raises(TrainingDivergedError,
                       match=r"rank 2: iteration 7: unexpected result nan .*bucket #0"):
        validate_without_rerun(validator, _grads(math.nan, 1.0), rank=2, iteration=7)


# ------------------------------------------ the second re-run, from the checkpoint (exit 16 -> resume)

def _exit_16(script, config, *runs):
    engine = script.engine(config)
    script.iteration(engine, 1, [2.0])
    _, stop = script.iteration(engine, 2, *runs)
    assert stop.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE and stop.save_checkpoint
    return stop.checkpoint_state


def _elsewhere(state):
    return {**state, "node": state["node"] + "-other"}


def test_the_checkpoint_state_says_what_was_rejected_and_where():
    state = _exit_16(Script(), _config(), [2.0, math.nan], [2.0, math.nan])
    assert state["iteration"] == 2 and (state["node"], state["device"]) == this_hardware()
    failure = state["failure"]
    assert failure["message"] == "found NaN in local forward loss calculation"
    assert failure["invocation"] == 2 and math.isnan(failure["initial"]) and failure["fatal"]


@pytest.mark.parametrize("rerun, status, verdict", [
    ([2.0, math.nan], "second_rerun_reproducible", "'correct result'"),
    ([2.0, 2.0], "second_rerun_not_reproducible", "'persistent error'")])
def test_the_resumed_job_re_runs_on_other_hardware_and_gives_megatrons_verdict(
        rerun, status, verdict, tmp_path):
    tracker = tmp_path / "rejected.txt"
    state = _exit_16(Script(), _config(), [2.0, math.nan], [2.0, math.nan])
    script = Script()
    engine = script.engine(_config(tracker=str(tracker)))
    engine.resume_from_checkpoint(_elsewhere(state))
    result, stop = script.iteration(engine, 2, rerun)
    assert script.calls == 1 and script.restored == []  # one run, from the checkpoint's state
    assert stop.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION and not stop.save_checkpoint
    assert verdict in stop.message
    assert f"status={status}" in tracker.read_text()
    assert script.iteration(engine, 3, [math.nan])[1] is not None  # validated as usual again


def test_landing_on_the_same_node_and_device_asks_to_resume_again():
    state = _exit_16(Script(), _config(), [math.nan], [math.nan])
    script = Script()
    engine = script.engine()
    engine.resume_from_checkpoint(state)
    _, stop = script.iteration(engine, 2, [math.nan])
    assert stop.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE and not stop.save_checkpoint
    assert "resume again from the same checkpoint on other hardware" in stop.message


@pytest.mark.parametrize("kind, verdict", [("persistent_error", "'persistent error'"),
                                           ("correct_result", "'correct result'")])
def test_an_injected_error_keeps_its_type_through_the_checkpoint(kind, verdict):
    state = _exit_16(Script(), _config(rate=1, kind=kind), [2.0], [2.0])
    assert state["failure"]["injected"] == kind
    script = Script()
    engine = script.engine()
    engine.resume_from_checkpoint(_elsewhere(state))
    _, stop = script.iteration(engine, 2, [2.0])
    assert stop.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION and verdict in stop.message


def test_a_rank_without_a_rejection_follows_the_worlds_verdict():
    votes = iter([[False, True, False]])
    script = Script()
    engine = script.engine(agree_any=lambda flags: next(votes))
    engine.resume_from_checkpoint({"iteration": 4, "node": "n", "device": "0", "failure": None})
    _, stop = script.iteration(engine, 4, [2.0])
    assert stop.exit_code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert "'persistent error'" in stop.message and script.calls == 1


def test_a_pending_re_run_of_another_iteration_is_dropped():
    script = Script()
    engine = script.engine()
    engine.resume_from_checkpoint({"iteration": 9, "node": "n", "device": "0", "failure": None})
    engine.first_iteration_complete = True
    assert script.iteration(engine, 4, [2.0]) == ([2.0], None)
    assert engine.from_checkpoint is None


# --------------------------------------------------------- --rerun-mode report_stats (determinism)

def test_report_stats_runs_every_iteration_twice_and_reports_every_second_one():
    lines = []
    script = Script()
    engine = RerunEngine.from_config(_config(mode="report_stats"), 0, device=None,
                                     save_state=lambda: "start",
                                     restore_state=script.restored.append,
                                     agree_any=lambda flags: list(flags), log=lines.append)
    engine.determinism.gather = lambda stats: [stats]  # one process
    result, stop = script.iteration(engine, 1, [2.0, 3.0], [2.0, 3.0 * (1 + 1e-4)])
    assert (result, stop) == ([2.0, 3.0 * (1 + 1e-4)], None)  # continues with the second run
    assert script.calls == 2 and script.restored == ["start"] and lines == []
    script.iteration(engine, 2, [2.0, 3.0], [2.0, 3.0])
    assert lines[0] == "Stats on computation determinism in validation calls"
    nan_line = next(line for line in lines if "found NaN in local forward loss" in line)
    assert "4/3 total/identical samples" in nan_line and "max: 1.000E-04" in nan_line


def test_report_stats_never_rejects_a_result():
    script = Script()
    engine = RerunEngine.from_config(_config(mode="report_stats", rate=1), 0, device=None,
                                     save_state=lambda: None, restore_state=lambda state: None,
                                     agree_any=lambda flags: list(flags), log=lambda line: None)
    engine.determinism.gather = lambda stats: [stats]
    engine.first_iteration_complete = True
    for iteration in (1, 2, 3):
        assert script.iteration(engine, iteration, [math.nan], [math.nan])[1] is None


def test_determinism_summary_reads_like_megatrons():
    stats = DeterminismStats()
    for _ in range(3):
        stats.record(0.0)
    assert stats.summary() == "3 samples, all identical"
    stats.record(2e-3)
    assert stats.summary() == ("4/3 total/identical samples, rel. variability: avg= 5.000E-04, "
                               "p50= 0.0, p90= 2.000E-03, p99= 2.000E-03, p99.9= 2.000E-03, "
                               "max: 2.000E-03")
    merged = DeterminismStats()
    merged.absorb(stats)
    merged.absorb(stats)
    assert (merged.identical, merged.samples, merged.largest) == (6, [2e-3, 2e-3], 2e-3)
