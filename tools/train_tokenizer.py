#!/usr/bin/env python
"""Train a SentencePiece BPE tokenizer offline from a JSONL corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8000 --output-prefix data/tok

writes ``data/tok.model`` (use it with ``--tokenizer-type SentencePieceTokenizer --tokenizer-model``)
and ``data/tok.vocab``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.tokenizer.sentencepiece_training import train_sentencepiece  # noqa: E402


def iterate_documents(paths, json_keys, max_bytes):
    """Texts of ``json_keys`` from JSONL files, up to ``max_bytes`` characters; bad lines skipped."""
    seen = 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                try:
                    document = json.loads(line)
                except json.JSONDecodeError:
                    continue
                for key in json_keys:
                    text = document.get(key) if isinstance(document, dict) else None
                    if isinstance(text, str) and text:
                        yield text
                        seen += len(text)
                        if max_bytes and seen >= max_bytes:
                            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL file(s).")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--output-prefix", required=True, help="Writes PREFIX.model, PREFIX.vocab.")
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    parser.add_argument("--max-training-characters", type=int, default=50_000_000,
                        help="Train on at most this much text (0: all).")
    parser.add_argument("--workers", type=int, default=2, help="SentencePiece training threads.")
    args = parser.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            print(f"error: input file {path} does not exist", file=sys.stderr)
            return 1
    try:
        model = train_sentencepiece(
            iterate_documents(args.input, args.json_keys, args.max_training_characters),
            args.output_prefix, vocab_size=args.vocab_size, model_type=args.model_type,
            num_threads=args.workers)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {model}; use --tokenizer-type SentencePieceTokenizer --tokenizer-model {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
