"""Tier 1 (one process): ``--rerun-mode validate_results`` in real runs of ``pretrain_gpt``: no fault
leaves the losses bit-identical, injected and real faults end the run with Megatron's exit
statuses (17 transient, 16 reproducible after saving a checkpoint)."""

import pytest

import pretrain_gpt
from megatron.training.checkpointing import read_tracker
from megatron.training.rerun import (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                     EXIT_CODE_RESUME_TO_DISAMBIGUATE)

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 "
        "--train-iters 4").split()


def _losses(*extra):
    result = pretrain_gpt.train_one_job(TINY + [str(item) for item in extra], log=lambda _: None)
    return [record.losses["lm loss"] for record in result.history], result


def test_validation_without_faults_changes_no_loss():
    plain, _ = _losses()
    validated, result = _losses("--rerun-mode", "validate_results", "--check-for-spiky-loss")
    assert validated == plain and len(plain) == 4 and result.exit_code == 0


def test_per_bucket_gradient_checks_change_no_loss():
    """--check-for-large-grads and --check-for-nan-in-loss-and-grad read every gradient bucket's
    local norm before its reduction, with and without the engine; the losses stay bit-identical."""
    plain, _ = _losses()
    checks = ("--check-for-large-grads", "--check-for-nan-in-loss-and-grad")
    validated, result = _losses("--rerun-mode", "validate_results", *checks)
    alone, _ = _losses(*checks)
    assert validated == plain == alone and result.exit_code == 0


def test_report_stats_reruns_every_iteration_and_reports_identical_results(capsys):
    """--rerun-mode report_stats: each iteration twice from its own state; on this deterministic
    CPU run every result is identical, the losses are those of a plain run."""
    plain, _ = _losses()
    reported, result = _losses("--rerun-mode", "report_stats", "--check-for-large-grads")
    assert reported == plain and result.exit_code == 0
    pretrain_gpt.main(TINY + ["--rerun-mode", "report_stats"])
    out = capsys.readouterr().out
    assert out.count("Stats on computation determinism in validation calls") == 2  # iter 2, 4
    assert "  found NaN in local forward loss calculation: 8 samples, all identical" in out


def test_an_injected_transient_error_stops_with_17_after_the_first_iteration(capsys):
    code = pretrain_gpt.main(TINY + ["--rerun-mode", "validate_results", "--error-injection-rate",
                                     "1", "--error-injection-type", "transient_error"])
    out = capsys.readouterr().out
    assert code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert " iteration        1/" in out and " iteration        2/" not in out
    assert "re-run engine: iteration 2: a rejected result did not reproduce" in out


def test_an_injected_persistent_error_saves_then_stops_with_16(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    code = pretrain_gpt.main(TINY + ["--rerun-mode", "validate_results", "--error-injection-rate",
                                     "1", "--error-injection-type", "persistent_error",
                                     "--save", save, "--save-interval", "100"])
    assert code == EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert read_tracker(save) == 1  # the last completed iteration, to re-run the next one from
    assert "resume from it on other GPUs" in capsys.readouterr().out


def test_a_real_nan_reproduces_and_stops_with_16(tmp_path):
    tracker = tmp_path / "rejected.txt"
    code = pretrain_gpt.main(TINY + ["--rerun-mode", "validate_results", "--init-method-std",
                                     "1e10", "--result-rejected-tracker-filename", str(tracker)])
    assert code == EXIT_CODE_RESUME_TO_DISAMBIGUATE
    statuses = [line.split(" status=")[1].split()[0] for line in tracker.read_text().splitlines()]
    assert statuses == ["initial_run", "first_rerun_reproducible"]


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_resuming_after_16_re_runs_the_iteration_on_other_hardware(tmp_path, capsys, monkeypatch,
                                                                   ckpt_format):
    """Megatron's second re-run: the checkpoint saved at exit 16 carries the engine's state; the
    resumed job re-runs that iteration, asks for other hardware if it landed on the same node, and
    otherwise gives the verdict (an injected persistent error: the result differs there) and
    exits 17 without saving."""
    save = str(tmp_path / "ckpt")
    tracker = tmp_path / "rejected.txt"
    common = ["--rerun-mode", "validate_results", "--save", save, "--save-interval", "1",
              "--ckpt-format", ckpt_format, "--result-rejected-tracker-filename", str(tracker)]
    monkeypatch.setenv("SLURMD_NODENAME", "node-a")
    assert pretrain_gpt.main(TINY + common + ["--error-injection-rate", "1", "--error-injection-type",
                                              "persistent_error"]) \
        == EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert read_tracker(save) == 1  # re-saved with the engine's state, at the same iteration
    resume = TINY + common + ["--load", save]
    assert pretrain_gpt.main(resume) == EXIT_CODE_RESUME_TO_DISAMBIGUATE  # same node: again
    assert "resume again from the same checkpoint on other hardware" in capsys.readouterr().out
    monkeypatch.setenv("SLURMD_NODENAME", "node-b")
    assert pretrain_gpt.main(resume) == EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    out = capsys.readouterr().out
    assert "asks to re-run iteration 2 on other hardware" in out and "'persistent error'" in out
    assert read_tracker(save) == 1  # nothing saved by the diagnosis
    statuses = [line.split(" status=")[1].split()[0] for line in tracker.read_text().splitlines()]
    assert statuses == ["initial_run", "first_rerun_reproducible",
                        "second_rerun_not_reproducible"]
