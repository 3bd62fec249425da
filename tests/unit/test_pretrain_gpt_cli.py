"""pretrain_gpt.py turns configuration mistakes into one readable error line and exit status 2."""

import pytest

import pretrain_gpt

TINY = ("--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 2 --lr 1e-3 --train-iters 5").split()


@pytest.mark.parametrize("extra,expected", [
    (["--mock-data", "--pipeline-model-parallel-size", "1", "--pipeline-schedule", "chimera"],
     "Chimera needs an even pipeline depth"),
    (["--mock-data", "--global-batch-size", "3"], "--global-batch-size 3 is not divisible"),
    (["--data-path", "x", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
      "/does/not/exist.model"], "/does/not/exist.model does not exist"),
])
def test_configuration_errors_print_one_line_and_exit_2(extra, expected, capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(TINY + extra)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("pretrain_gpt.py: error: ") and expected in error
    assert "Traceback" not in error


def test_python_in_an_sbatch_script_without_srun_fails_at_once(capsys, monkeypatch):
    """The batch step of ``sbatch --ntasks 8``: one process where 8 are expected. It must stop
    before any rendezvous (which would wait for --distributed-timeout-minutes)."""
    import time

    for name in ("WORLD_SIZE", "RANK", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node[1-2]"}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(TINY + ["--mock-data"])
    assert exit_info.value.code == 2 and time.monotonic() - started < 10
    error = capsys.readouterr().err
    assert error.startswith("pretrain_gpt.py: error: SLURM_NTASKS=8") and "srun" in error


def _write_tiny_dataset(prefix):
    import numpy as np

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    builder.add_document(np.arange(1, 40, dtype=np.uint16), [39])
    builder.finalize(str(prefix) + ".idx")


@pytest.mark.parametrize("case,expected", [
    ("missing prefix", "nothere.idx does not exist; --data-path takes the prefix without extension"),
    ("missing idx", "onlybin.idx does not exist"),
    ("prefix with .bin", "names a file, not a dataset prefix: pass "),
    ("blend with .idx", "names a file, not a dataset prefix: pass "),
    ("tracker not a number", "contains 'abc', expected an iteration number"),
    ("tracker names a missing iteration", "names iteration 20, but iter_0000020 does not exist "
                                          "there; the directory holds iter_0000010"),
])
def test_missing_data_and_bad_load_tracker_stop_before_any_process_group(case, expected, tmp_path,
                                                                         capsys, monkeypatch):
    """Mistakes Megatron users make with their files: one line naming the file and the fix, exit 2,
    from the configuration step (before any rendezvous), not a traceback per rank after it."""
    for name in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    corpus = tmp_path / "corpus_text_document"
    _write_tiny_dataset(corpus)
    (tmp_path / "onlybin.bin").write_bytes(b"\0" * 8)
    checkpoints = tmp_path / "ckpt"
    (checkpoints / "iter_0000010").mkdir(parents=True)
    data = ["--data-path", str(corpus), "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    extra = {
        "missing prefix": ["--data-path", str(tmp_path / "nothere"), *data[2:]],
        "missing idx": ["--data-path", str(tmp_path / "onlybin"), *data[2:]],
        "prefix with .bin": ["--data-path", f"{corpus}.bin", *data[2:]],
        "blend with .idx": ["--data-path", "0.5", str(corpus), "0.5", f"{corpus}.idx", *data[2:]],
        "tracker not a number": [*data, "--load", str(checkpoints)],
        "tracker names a missing iteration": [*data, "--load", str(checkpoints)],
    }[case]
    tracker = {"tracker not a number": "abc\n", "tracker names a missing iteration": "20\n"}
    if case in tracker:
        (checkpoints / "latest_checkpointed_iteration.txt").write_text(tracker[case])
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(TINY + ["--global-batch-size", "2", "--max-position-embeddings", "64"]
                          + extra)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("pretrain_gpt.py: error: ") and expected in error, error
    assert "Traceback" not in error


def test_help_says_how_to_switch_to_chimera_its_variants_and_what_is_refused(capsys):
    """What a Megatron user looks for in --help: how to switch schedules, what Chimera needs, what
    each variant and grad-sync policy does, and where the unimplemented features are."""
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for phrase in ("add --pipeline-schedule chimera (an even --pipeline-model-parallel-size",
                   "the losses equal 1f1b's up to rounding",
                   "mixture of experts, FP8, context parallelism",
                   "direct (basic units back to back)", "forward-doubling (two forwards per step",
                   "backward-halving (forward doubling on half micro-batches",
                   "interleaved (each direction cut into 2D half-size stages",
                   "eager-opt (after the stage's last backward", "end (after the whole schedule)"):
        assert phrase in text, phrase
