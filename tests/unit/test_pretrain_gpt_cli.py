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
