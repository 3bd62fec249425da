#!/usr/bin/env python
"""Build the offline demo corpus: Python standard-library source, a SentencePiece tokenizer, and
the preprocessed Megatron dataset. No download, no text in the repository, a few seconds.

    python tools/build_demo_corpus.py            # writes data/demo/, prints the training flags

The corpus is this interpreter's own standard library (every Python install ships it): a
deterministic selection of modules, capped at --max-megabytes, cut into documents at top-level
definitions. Running it again with the same settings reuses what is there (use --force to rebuild).
"""

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.config import DataConfig  # noqa: E402
from megatron.core.datasets.preprocessing import preprocess_jsonl  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from megatron.training.tokenizer.sentencepiece_training import train_sentencepiece  # noqa: E402

# Bump when the corpus recipe changes, so existing builds are redone.
RECIPE_VERSION = 1
# Folders of the standard library that are tests, vendored packages or generated tables.
SKIPPED_FOLDERS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                   "encodings", "lib2to3", "ensurepip", "config-3"}
# Files larger than this are generated data rather than code worth modelling.
MAX_FILE_BYTES = 400_000
DOCUMENT_CHARACTERS = 3000
TOP_LEVEL_START = re.compile(r"^(def |class |async def |@|if __name__)")


def stdlib_sources(stdlib_dir: str) -> list[str]:
    """Relative paths of the standard library's .py files, in a fixed order that mixes packages."""
    found = []
    for folder, subfolders, files in os.walk(stdlib_dir):
        subfolders[:] = sorted(name for name in subfolders
                               if name not in SKIPPED_FOLDERS and not name.startswith("config-"))
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and os.path.getsize(path) <= MAX_FILE_BYTES:
                found.append(os.path.relpath(path, stdlib_dir))
    # Ordered by a hash of the path: stable everywhere, and a size cap takes a mix of packages.
    return sorted(found, key=lambda rel: hashlib.md5(rel.encode()).hexdigest())


def split_into_documents(source: str) -> list[str]:
    """Cut a module into documents of about DOCUMENT_CHARACTERS at top-level definitions."""
    documents, current, size = [], [], 0
    for line in source.splitlines(keepends=True):
        if size >= DOCUMENT_CHARACTERS and TOP_LEVEL_START.match(line):
            documents.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        documents.append("".join(current))
    return [document for document in documents if document.strip()]


def collect_documents(stdlib_dir: str, max_bytes: int) -> tuple[list[str], int]:
    """Documents from standard-library modules until ``max_bytes`` characters; also the file count."""
    documents, total, files = [], 0, 0
    for relative in stdlib_sources(stdlib_dir):
        if total >= max_bytes:
            break
        with open(os.path.join(stdlib_dir, relative), encoding="utf-8", errors="replace") as handle:
            source = handle.read()
        documents.extend(split_into_documents(source))
        total += len(source)
        files += 1
    return documents, files


def build_demo_corpus(output_dir: str = "data/demo", max_megabytes: float = 4.0,
                      vocab_size: int = 4096, force: bool = False, log=print) -> dict:
    """Build (or reuse) the demo corpus in ``output_dir``; returns the training flags as a dict."""
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    settings = {"recipe": RECIPE_VERSION, "python": sys.version.split()[0], "stdlib": stdlib_dir,
                "max_megabytes": max_megabytes, "vocab_size": vocab_size}
    corpus_path = os.path.join(output_dir, "corpus.jsonl")
    tokenizer_prefix = os.path.join(output_dir, "tokenizer")
    data_prefix = os.path.join(output_dir, "corpus_text_document")
    manifest_path = os.path.join(output_dir, "manifest.json")
    flags = {"data_path": data_prefix, "tokenizer_type": "SentencePieceTokenizer",
             "tokenizer_model": tokenizer_prefix + ".model"}
    outputs = [corpus_path, tokenizer_prefix + ".model", data_prefix + ".bin", data_prefix + ".idx"]

    if not force and os.path.isfile(manifest_path) and all(map(os.path.isfile, outputs)):
        with open(manifest_path, encoding="utf-8") as handle:
            if json.load(handle).get("settings") == settings:
                log(f"demo corpus in {output_dir} is up to date (use --force to rebuild)")
                return flags

    start = time.perf_counter()
    if os.path.isdir(output_dir):
        # Stale outputs and index caches of an older build must not survive a rebuild.
        shutil.rmtree(output_dir)
    os.makedirs(output_dir)
    documents, files = collect_documents(stdlib_dir, int(max_megabytes * 1e6))
    if not documents:
        raise RuntimeError(f"no Python sources found under {stdlib_dir}; the standard library "
                           f"source is missing from this Python install")
    with open(corpus_path + ".partial", "w", encoding="utf-8") as handle:
        for document in documents:
            handle.write(json.dumps({"text": document}) + "\n")
    os.replace(corpus_path + ".partial", corpus_path)
    characters = sum(len(document) for document in documents)
    log(f"corpus: {len(documents)} documents from {files} standard-library modules, "
        f"{characters / 1e6:.1f} M characters -> {corpus_path}")

    train_sentencepiece(documents, tokenizer_prefix, vocab_size=vocab_size)
    log(f"tokenizer: SentencePiece BPE, {vocab_size} pieces -> {tokenizer_prefix}.model")

    data_config = DataConfig(tokenizer_type="SentencePieceTokenizer",
                             tokenizer_model=tokenizer_prefix + ".model")
    stats = preprocess_jsonl(corpus_path, os.path.join(output_dir, "corpus"),
                             functools.partial(build_tokenizer, data_config, None),
                             append_eod=True, workers=1, log_interval=0, log=log)
    with open(manifest_path, "w", encoding="utf-8") as handle:
        json.dump({"settings": settings, "documents": stats.documents, "tokens": stats.tokens,
                   "modules": files}, handle, indent=2)
    log(f"built in {time.perf_counter() - start:.1f} s")
    return flags


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="data/demo")
    parser.add_argument("--max-megabytes", type=float, default=4.0,
                        help="Characters of source to take, in millions.")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--force", action="store_true", help="Rebuild even if up to date.")
    args = parser.parse_args(argv)
    try:
        flags = build_demo_corpus(args.output_dir, args.max_megabytes, args.vocab_size, args.force)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("train on it with:\n  --data-path {data_path} --tokenizer-type {tokenizer_type} "
          "--tokenizer-model {tokenizer_model}".format(**flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
