"""Smoke (tier 3): ``pretrain_gpt.py --fim-data`` trains on GPT-2 data whose vocabulary holds the
FIM tokens, and stops with the fix named when the vocabulary lacks them."""

import json

import pytest

from data_helpers import gpt2_corpus
from torchrun_helpers import finish, launch, logged_losses

pytestmark = pytest.mark.smoke

FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")


def _model_flags():
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "3e-3", "--train-iters", "6", "--log-interval",
            "1", "--eval-iters", "1", "--eval-interval", "6", "--split", "949,50,1", "--seed",
            "1234", "--fim-data", "--fim-rate", "0.5", "--fim-spm-rate", "0.5"]


def test_pretrain_gpt_trains_with_fim_data(tmp_path):
    data_flags = gpt2_corpus(tmp_path)
    vocab_path = data_flags[data_flags.index("--vocab-file") + 1]
    vocab = json.loads(open(vocab_path, encoding="utf-8").read())
    for token in FIM_TOKENS:
        vocab[token] = len(vocab)
    open(vocab_path, "w", encoding="utf-8").write(json.dumps(vocab))
    output = finish(launch(1, _model_flags() + data_flags), timeout=240)
    losses = logged_losses(output, 6)
    assert all(loss == loss and loss < 20 for loss in losses), losses
    assert "validation loss at iteration 6" in output


def test_pretrain_gpt_fim_without_the_tokens_names_the_fix(tmp_path):
    process = launch(1, _model_flags() + gpt2_corpus(tmp_path))
    output, _ = process.communicate(timeout=240)
    assert process.returncode != 0
    assert "no token '<fim_prefix>'" in output and "--fim-prefix-token" in output, output[-2000:]
