#!/usr/bin/env python
"""Data-pipeline benchmark: preprocessing throughput and index building at a billion tokens.

    python benchmarks/data_pipeline.py [--megabytes 8] [--tokens 1e9]

1. Tokenisation: tools/preprocess_data's engine on standard-library text (the demo corpus recipe) with
   1 and 2 workers, for the SentencePiece tokenizer and for the GPT-2 byte-level BPE tokenizer
   (with a GPT-2-format vocabulary converted from the SentencePiece model, as no GPT-2 files can be
   downloaded here; pass --vocab-file/--merge-file to use the real ones).
2. Indexing: a synthetic indexed dataset of --tokens tokens (a sparse .bin, so no disk is used),
   timing the .idx write, the validated open, the cache fingerprint, and the GPT document/sample/
   shuffle indices for one epoch, plus random sample reads.

Prints one table. Runs in well under a minute on two cores.
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

from build_demo_corpus import collect_documents  # noqa: E402
from megatron.core.config import DataConfig  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, encode_index  # noqa: E402
from megatron.core.datasets.preprocessing import preprocess_jsonl  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from megatron.training.tokenizer.gpt2_bpe import bytes_to_unicode  # noqa: E402
from megatron.training.tokenizer.sentencepiece_training import train_sentencepiece  # noqa: E402


def sentencepiece_to_gpt2_files(model_file: str, directory: str) -> tuple[str, str]:
    """A GPT-2-format vocab.json/merges.txt with the pieces of a SentencePiece BPE model."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    table = bytes_to_unicode()
    vocab = {table[byte]: byte for byte in range(256)}
    merges = []

    def add(first: str, second: str) -> None:
        if first + second not in vocab:
            merges.append((first, second))
            vocab[first + second] = len(vocab)

    for piece_id in range(processor.get_piece_size()):
        if processor.is_control(piece_id) or processor.is_unknown(piece_id) or \
                processor.is_byte(piece_id):
            continue
        text = processor.id_to_piece(piece_id).replace("\u2581", " ")
        symbol = "".join(table[byte] for byte in text.encode("utf-8"))
        if symbol in vocab or len(symbol) < 2:
            continue
        split = next((k for k in range(1, len(symbol))
                      if symbol[:k] in vocab and symbol[k:] in vocab), None)
        if split is not None:
            add(symbol[:split], symbol[split:])
        else:  # characters of several bytes: merge left to right
            for end in range(2, len(symbol) + 1):
                add(symbol[:end - 1], symbol[end - 1])
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = (os.path.join(directory, "gpt2-vocab.json"),
                              os.path.join(directory, "gpt2-merges.txt"))
    with open(vocab_file, "w", encoding="utf-8") as handle:
        json.dump(vocab, handle)
    with open(merge_file, "w", encoding="utf-8") as handle:
        handle.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab_file, merge_file


def benchmark_tokenisation(work_dir, megabytes, vocab_file, merge_file, rows):
    documents, _ = collect_documents(__import__("sysconfig").get_paths()["stdlib"],
                                     int(megabytes * 1e6))
    corpus = os.path.join(work_dir, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as handle:
        for document in documents:
            handle.write(json.dumps({"text": document}) + "\n")
    model = train_sentencepiece(documents, os.path.join(work_dir, "spm"), vocab_size=8000)
    if vocab_file is None:
        vocab_file, merge_file = sentencepiece_to_gpt2_files(model, work_dir)
        gpt2_label = "GPT2BPETokenizer (converted vocab)"
    else:
        gpt2_label = "GPT2BPETokenizer"
    configs = [("SentencePieceTokenizer", DataConfig(tokenizer_type="SentencePieceTokenizer",
                                                     tokenizer_model=model)),
               (gpt2_label, DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                                       merge_file=merge_file))]
    size_mb = os.path.getsize(corpus) / 1e6
    for label, config in configs:
        vocab_size = build_tokenizer(config, None).vocab_size
        for workers in (1, 2):
            cpu_before = _cpu_seconds()
            stats = preprocess_jsonl(corpus, os.path.join(work_dir, f"out{workers}"),
                                     functools.partial(build_tokenizer, config, None),
                                     append_eod=True, workers=workers, log_interval=0,
                                     log=lambda message: None)
            cpu_seconds = _cpu_seconds() - cpu_before
            rows.append((f"preprocess {size_mb:.1f} MB, {label}, vocab {vocab_size}",
                         f"{workers} worker{'s' if workers > 1 else ''}",
                         f"{stats.megabytes_per_second:.2f} MB/s",
                         f"{stats.documents_per_second:.0f} docs/s, "
                         f"{stats.tokens / stats.seconds / 1e6:.2f} M tokens/s, "
                         f"{stats.bytes_read / 1e6 / cpu_seconds:.2f} MB per CPU-second"))


def _cpu_seconds() -> float:
    """CPU time of this process and its finished worker processes (unaffected by other load)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def benchmark_indexing(work_dir, num_tokens, seq_length, rows):
    rng = np.random.default_rng(0)
    mean_length = 1000
    lengths = rng.integers(1, 2 * mean_length, int(num_tokens // mean_length), dtype=np.int64)
    lengths = lengths * num_tokens // lengths.sum()
    lengths[-1] += num_tokens - lengths.sum()  # exactly num_tokens (adds less than one per document)
    prefix = os.path.join(work_dir, "synthetic")
    label = f"{num_tokens / 1e9:g}e9 tokens, {lengths.size / 1e6:.1f} M documents"

    def write():
        with open(prefix + ".idx", "wb") as handle:
            handle.write(encode_index(np.uint16, lengths, np.arange(lengths.size + 1)))
        with open(prefix + ".bin", "wb") as handle:
            handle.truncate(int(num_tokens) * 2)  # sparse: no data written
    _, seconds = timed(write)
    rows.append((f"write .idx ({label})", "", f"{seconds:.2f} s", ""))
    dataset, seconds = timed(lambda: IndexedDataset(prefix))
    rows.append(("open + validate .bin/.idx", "", f"{seconds:.2f} s", ""))
    _, seconds = timed(dataset.fingerprint)
    rows.append(("cache key (hash of .idx)", "", f"{seconds:.2f} s", ""))
    documents = np.arange(len(dataset))
    gpt, seconds = timed(lambda: GPTDataset(dataset, documents, seq_length, None, seed=1234))
    rows.append((f"GPT indices, one epoch, seq {seq_length}", "", f"{seconds:.2f} s",
                 f"{len(gpt)} samples"))
    picks = rng.integers(0, len(gpt), 20000)
    _, seconds = timed(lambda: [gpt[int(i)] for i in picks])
    rows.append((f"random sample reads, seq {seq_length}", "", f"{picks.size / seconds:.0f} /s",
                 ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=4.0, help="Text to tokenise.")
    parser.add_argument("--tokens", type=float, default=1e9, help="Synthetic index size.")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-file", help="Real GPT-2 vocab.json (optional).")
    parser.add_argument("--merge-file", help="Real GPT-2 merges.txt (optional).")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="data-bench-") as work_dir:
        benchmark_tokenisation(work_dir, args.megabytes, args.vocab_file, args.merge_file, rows)
        benchmark_indexing(work_dir, int(args.tokens), args.seq_length, rows)
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(f"data pipeline on {os.cpu_count()} CPU cores (load average at the end: "
          f"{os.getloadavg()[0]:.1f}; wall-clock MB/s drops when other work shares the cores)")
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
