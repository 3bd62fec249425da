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
