"""Smoke (tier 3): issue 6's "Done when": ``pretrain_gpt.py --data-path P --tokenizer-type
GPT2BPETokenizer --vocab-file V --merge-file M`` trains on a dataset written in Megatron's format
(here by tools/preprocess_data.py, whose bytes the unit tests pin to Megatron's layout), with Chimera."""

import json
import subprocess
import sys

import pytest

from data_helpers import gpt2_files
from torchrun_helpers import REPO, finish, launch, logged_losses

pytestmark = pytest.mark.smoke


def test_pretrain_gpt_trains_on_preprocessed_gpt2_data(tmp_path):
    vocab, merges = gpt2_files(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": f"the cat number {i} sat on the mat and the dog ran away"})
             for i in range(200)]
    corpus.write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "corpus"
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                    "--json-keys", "text", "--output-prefix", str(prefix), "--tokenizer-type",
                    "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                    "--append-eod", "--workers", "1"], cwd=REPO, check=True, timeout=120,
                   capture_output=True)
    output = finish(launch(2, [
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "chimera",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "3e-3", "--train-iters", "8", "--log-interval", "1",
        "--eval-iters", "1", "--eval-interval", "8", "--split", "949,50,1", "--seed", "1234",
        "--data-path", f"{prefix}_text_document", "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges]), timeout=240)
    losses = logged_losses(output, 8)
    assert losses[-1] < losses[0], losses
    assert "validation loss at iteration 8" in output
