"""Faults a single-process ``pretrain_gpt.main`` must stop on, before or during training: NaN,
overwriting checkpoints, an unusable --save (tier 1, one process)."""

import os

import pytest

import pretrain_gpt
from megatron.training.checkpointing import iteration_dir_name, read_tracker
from megatron.training.iteration_health import TrainingDivergedError

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --vocab-size 64 --mock-data --seed 1234 "
        "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 "
        "--train-iters 4").split()


def _main(*extra):
    pretrain_gpt.main(TINY + [str(item) for item in extra])


def test_nan_run_stops_with_iteration_and_rank(capsys):
    """Megatron's per-bucket check stops it before the update, naming the rank, the iteration
    and the first gradient bucket whose local norm is not finite."""
    with pytest.raises(TrainingDivergedError, match=r"rank 0: iteration 1: unexpected result "
                       r"(nan|inf) \(message='found (NaN|Inf) in local grad norm for bucket #0"):
        _main("--init-method-std", "1e10", "--check-for-nan-in-loss-and-grad")


def test_endlessly_skipping_run_stops(tmp_path):
    save = tmp_path / "ckpt"
    with pytest.raises(TrainingDivergedError, match="last 2 iterations all skipped"):
        _main("--init-method-std", "1e10", "--max-consecutive-skipped-iterations", "2",
              "--save", save, "--save-interval", "3")
    assert read_tracker(str(save)) is None  # nothing was saved from the diverged run


def test_overwrite_cases_stop_before_training(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    _main("--save", save, "--save-interval", "2")
    assert read_tracker(save) == 4
    os.remove(os.path.join(save, "latest_checkpointed_iteration.txt"))
    stamp = os.path.getmtime(os.path.join(save, iteration_dir_name(4)))
    for extra in (["--load", save], ["--load", save + "-typo"]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            _main("--save", save, *extra)
        assert stopped.value.code == 2
        assert "already holds checkpoints (iter_0000002, iter_0000004)" in capsys.readouterr().err
    assert os.path.getmtime(os.path.join(save, iteration_dir_name(4))) == stamp
    _main("--save", save, "--allow-overwrite-checkpoints", "--train-iters", "1")
    assert read_tracker(save) == 1


def test_unwritable_save_fails_before_iteration_one(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as stopped:
        _main("--save", blocker / "ckpt")
    assert stopped.value.code == 2
    output = capsys.readouterr()
    assert "is not a writable directory" in output.err
    assert " iteration " not in output.out


def test_empty_train_split_says_there_is_no_training_data(tmp_path):
    import numpy as np

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for start in range(0, 200, 20):
        builder.add_document(np.arange(start, start + 20) % 64)
    builder.finalize(prefix + ".idx")
    flags = [flag for flag in TINY if flag != "--mock-data"]
    with pytest.raises(ValueError, match=f"there is no training data: --data-path {prefix} with "
                                         f"--split 0,1,0 leaves the train split empty"):
        pretrain_gpt.main(flags + ["--data-path", prefix, "--split", "0,1,0",
                               "--tokenizer-type", "NullTokenizer"])


def test_exit_on_missing_checkpoint_stops_instead_of_starting_afresh(tmp_path):
    from megatron.training.checkpointing import CheckpointError
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint: --load .* holds no "
                                              "checkpoint"):
        _main("--load", tmp_path / "empty", "--exit-on-missing-checkpoint")


def test_iterations_to_skip_consume_their_samples_and_train_nothing(capsys):
    """--iterations-to-skip 1 (Megatron's numbering): the step after one completed iteration is
    skipped: its samples are consumed (the run ends with a plain run's sample count) and the
    learning-rate schedule advances only on trained iterations; a negative N is refused."""
    plain = pretrain_gpt.train_one_job(TINY + ["--lr-decay-style", "linear"], log=lambda _: None)
    skipping = pretrain_gpt.train_one_job(TINY + ["--lr-decay-style", "linear",
                                                  "--iterations-to-skip", "1"], log=print)
    assert [r.iteration for r in skipping.history] == [1, 3, 4]
    assert skipping.history[0].losses == plain.history[0].losses
    assert skipping.state.consumed_train_samples == plain.state.consumed_train_samples == 16
    assert [r.learning_rate for r in skipping.history] == \
        [r.learning_rate for r in plain.history[:3]]
    assert "skipping iteration 2 (--iterations-to-skip): its 4 samples" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _main("--iterations-to-skip", "-1")
    assert "--iterations-to-skip [-1] must be >= 0" in capsys.readouterr().err
