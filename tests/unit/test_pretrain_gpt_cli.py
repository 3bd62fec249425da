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
