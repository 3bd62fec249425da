"""Small data files shared by the data tests: a tiny GPT-2 vocabulary (vocab.json + merges.txt)."""

import json

from megatron.training.tokenizer.gpt2_bpe import bytes_to_unicode


def gpt2_files(directory):
    """A tiny GPT-2 vocabulary: the 256 byte symbols, a few merges, <|endoftext|>."""
    table = bytes_to_unicode()
    vocab = {table[byte]: byte for byte in range(256)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a")]
    for first, second in merges:
        vocab[first + second] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def gpt2_corpus(directory):
    """A tiny preprocessed corpus (``corpus_text_document``) tokenized with :func:`gpt2_files`;
    returns the data and tokenizer flags that train on it."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    vocab, merges = gpt2_files(directory)
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the cat {i} sat on the mat and ran"}) + "\n"
                              for i in range(60)))
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                    "--json-keys", "text", "--output-prefix", str(directory / "corpus"),
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                    "--merge-file", merges, "--append-eod", "--workers", "1"], cwd=repo,
                   check=True, timeout=120, capture_output=True)
    return ["--data-path", str(directory / "corpus_text_document"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


class UnevenLossMask:
    """A dataset whose samples carry loss masks of different lengths: the samples whose index is
    ``remainder`` modulo ``period`` count only their first ``kept`` tokens."""

    def __init__(self, dataset, period: int, remainder: int, kept: int):
        self.dataset, self.period, self.remainder, self.kept = dataset, period, remainder, kept

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        import numpy as np

        sample = dict(self.dataset[index])
        mask = np.ones(len(sample["text"]) - 1, dtype=np.float32)
        if index % self.period == self.remainder:
            mask[self.kept:] = 0
        sample["loss_mask"] = mask
        return sample


def uneven_loss_mask_datasets(config, parallel_state, num_samples, *, period, remainder, kept):
    """pretrain_gpt's datasets with :class:`UnevenLossMask` masks (bind the keywords with
    functools.partial to get a datasets provider)."""
    import pretrain_gpt

    return tuple(None if d is None else UnevenLossMask(d, period, remainder, kept)
                 for d in pretrain_gpt.datasets_provider(config, parallel_state, num_samples))
