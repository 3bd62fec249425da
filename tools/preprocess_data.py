#!/usr/bin/env python
"""Tokenise a JSONL corpus into Megatron's indexed-dataset format (``PREFIX_text_document.bin/.idx``).

Same interface as Megatron-LM's tool::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod --workers 2

Then train with ``--data-path data/corpus_text_document``. ``--input`` also takes a glob
(``--input 'shards/*.jsonl'``, quoted): the matching files are read in sorted order into one output.
An input with no usable document (an empty file, a compressed file, every line bad) exits with
status 1 and a message naming the file, what was wrong and the fix.
"""

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.config import DataConfig, ModelConfig  # noqa: E402
from megatron.core.datasets.preprocessing import (BadLineError, UnusableInputError,  # noqa: E402
                                                   preprocess_jsonl)
from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, nargs="+",
                       help="JSONL file, one JSON document per line; or a glob such as "
                            "'shards/*.jsonl' (quote it), whose matches are read in sorted order "
                            "into one output. Several files or globs may be given.")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="Keys whose text is tokenised (one output dataset per key).")
    group.add_argument("--split-sentences", action="store_true",
                       help="Not supported: documents are kept whole.")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Accepted for compatibility; newlines are always kept.")
    group.add_argument("--lang", default=None,
                       help="Megatron's language for NLTK sentence splitting. Sentences are not "
                            "split here (see --split-sentences), so it is accepted and ignored "
                            "(a line in the log says so).")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT-2 vocab.json.")
    group.add_argument("--merge-file", help="GPT-2 merges.txt.")
    group.add_argument("--tokenizer-model",
                       help="SentencePiece .model file (SentencePiece, GPTSentencePiece, Llama2 "
                            "tokenizers); for HuggingFaceTokenizer a tokenizer directory or a "
                            "Hugging Face model name.")
    group.add_argument("--vocab-size", type=int, help="Vocabulary size for the NullTokenizer.")
    group.add_argument("--append-eod", action="store_true",
                       help="Append the end-of-document token to every document.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="Writes OUTPUT_PREFIX_{key}_document.bin/.idx.")
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                       help="Legacy; only mmap exists.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="Tokenising processes.")
    group.add_argument("--partitions", type=int, default=1,
                       help="Only 1 is supported (the input is streamed, not split).")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Megatron's flag keeps the input order when it partitions the input. "
                            "Here documents are always written in input order (files in the order "
                            "given, a glob's matches sorted, lines in order, with any --workers), "
                            "so the flag is accepted and changes nothing.")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="Print progress every this many documents.")
    group.add_argument("--strict", action="store_true",
                       help="Stop at the first bad line instead of reporting and skipping it.")
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences is not supported; documents are tokenised whole")
    if args.partitions != 1:
        parser.error("--partitions other than 1 is not supported; use --workers for parallelism")
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    data_config = DataConfig(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                             merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    model_config = ModelConfig(vocab_size=args.vocab_size)
    tokenizer_factory = functools.partial(build_tokenizer, data_config, model_config)
    if args.lang is not None:
        print(f"note: --lang {args.lang} is ignored: it only selects the sentence splitter, and "
              f"documents are not split into sentences", file=sys.stderr, flush=True)
    try:
        preprocess_jsonl(args.input, args.output_prefix, tokenizer_factory,
                         json_keys=args.json_keys, append_eod=args.append_eod,
                         workers=args.workers, log_interval=args.log_interval,
                         strict=args.strict,
                         log=lambda message: print(message, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError, BadLineError, UnusableInputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
