"""JSONL documents to Megatron indexed datasets (the engine of tools/preprocess_data.py).

Each line of the input is one JSON document; for every key in ``json_keys`` the text is tokenised
(in ``workers`` processes, order preserved) and written as one sequence per document to
``PREFIX_KEY_document.bin/.idx``, with the end-of-document id appended when ``append_eod``. Token
dtype is uint16 when the vocabulary fits, else int32, as in Megatron.

Bad lines (invalid UTF-8 or JSON, a missing key, a value that is not a string) are reported with
their line number and skipped, or abort the run when ``strict``. Outputs are written under temporary
names and renamed at the end, so an interrupted run never leaves a pair that looks complete.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, data_file_path,
                                                    index_file_path, optimal_token_dtype)

# Bad lines printed one by one; past this only the count is kept.
_MAX_REPORTED_BAD_LINES = 20


class BadLineError(ValueError):
    """A malformed input line in strict mode."""


@dataclass
class PreprocessStats:
    """What a preprocessing run did."""

    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    bad_lines: list = field(default_factory=list)  # (line number, reason)
    empty_documents: int = 0
    seconds: float = 0.0
    output_prefixes: dict = field(default_factory=dict)  # json key -> dataset prefix

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes_read / 1e6 / max(self.seconds, 1e-9)

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)


def output_prefix_for(output_prefix: str, json_key: str) -> str:
    """Megatron's naming: ``PREFIX_KEY_document``."""
    return f"{output_prefix}_{json_key}_document"


class _LineEncoder:
    """Turns one raw input line into token arrays per key, or a reason it is bad."""

    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool, dtype):
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.append_eod = append_eod
        self.dtype = dtype

    def __call__(self, numbered_line: tuple[int, bytes]):
        line_number, raw = numbered_line
        try:
            document = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            return line_number, len(raw), f"invalid UTF-8 ({error.reason} at byte {error.start})"
        except json.JSONDecodeError as error:
            return line_number, len(raw), f"invalid JSON ({error.msg} at column {error.colno})"
        if not isinstance(document, dict):
            return line_number, len(raw), "not a JSON object"
        encoded = {}
        for key in self.json_keys:
            if key not in document:
                return line_number, len(raw), f"missing key {key!r}"
            text = document[key]
            if not isinstance(text, str):
                return line_number, len(raw), f"{key!r} is a {type(text).__name__}, not a string"
            try:
                ids = self.tokenizer.tokenize(text) if text else []
            except ValueError as error:  # e.g. the NullTokenizer given words instead of ids
                return line_number, len(raw), f"cannot tokenise {key!r}: {error}"
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            encoded[key] = np.asarray(ids, dtype=self.dtype)
        return line_number, len(raw), encoded


# The tokenizer of a worker process, built once by the pool initializer (the one piece of
# per-process state; a tokenizer is too costly to rebuild per task).
_worker_encoder: Optional[_LineEncoder] = None


def _initialize_worker(tokenizer_factory, json_keys, append_eod, dtype) -> None:
    global _worker_encoder
    _worker_encoder = _LineEncoder(tokenizer_factory(), json_keys, append_eod, dtype)


def _encode_in_worker(numbered_line):
    return _worker_encoder(numbered_line)


def _numbered_lines(input_path: str) -> Iterator[tuple[int, bytes]]:
    with open(input_path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield line_number, raw


def preprocess_jsonl(input_path: str, output_prefix: str, tokenizer_factory: Callable,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                     workers: int = 1, log_interval: int = 1000, strict: bool = False,
                     log: Callable[[str], None] = print) -> PreprocessStats:
    """Tokenise ``input_path`` into ``PREFIX_KEY_document.bin/.idx`` per key.

    ``tokenizer_factory()`` builds the tokenizer (in each worker process); it must be picklable,
    e.g. ``functools.partial(build_tokenizer, data_config, model_config)``.
    """
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input file {input_path} does not exist; --input takes a JSONL "
                                f"file with one JSON document per line")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    tokenizer = tokenizer_factory()
    dtype = optimal_token_dtype(tokenizer.vocab_size)
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)

    stats = PreprocessStats()
    builders, final_paths = {}, {}
    for key in json_keys:
        prefix = output_prefix_for(output_prefix, key)
        stats.output_prefixes[key] = prefix
        final_paths[key] = (data_file_path(prefix), index_file_path(prefix))
        builders[key] = IndexedDatasetBuilder(data_file_path(prefix) + ".partial", dtype)

    start = time.perf_counter()
    pool = None
    try:
        if workers == 1:
            encoded_lines = map(_LineEncoder(tokenizer, json_keys, append_eod, dtype),
                                _numbered_lines(input_path))
        else:
            pool = multiprocessing.Pool(workers, initializer=_initialize_worker,
                                        initargs=(tokenizer_factory, list(json_keys), append_eod,
                                                  dtype))
            encoded_lines = pool.imap(_encode_in_worker, _numbered_lines(input_path), chunksize=64)
        for line_number, size, result in encoded_lines:
            stats.bytes_read += size
            if isinstance(result, str):
                _report_bad_line(stats, line_number, result, input_path, strict, log)
                continue
            added = _add_document(stats, builders, result)
            if added and log_interval and stats.documents % log_interval == 0:
                stats.seconds = time.perf_counter() - start
                log(f"processed {stats.documents} documents ({stats.documents_per_second:.0f} "
                    f"docs/s, {stats.megabytes_per_second:.2f} MB/s)")
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    _finalize_outputs(builders, final_paths)
    stats.seconds = time.perf_counter() - start
    _log_summary(stats, dtype, input_path, log)
    return stats


def _add_document(stats: PreprocessStats, builders: dict, result: dict) -> bool:
    """Append one encoded document (token ids per JSON key); False for an empty one (counted)."""
    if all(ids.size == 0 for ids in result.values()):
        stats.empty_documents += 1
        return False
    for key, ids in result.items():
        builders[key].add_document(ids)
        stats.tokens += int(ids.size)
    stats.documents += 1
    return True


def _finalize_outputs(builders: dict, final_paths: dict) -> None:
    """Write the indices and move the finished files into place (never a half-written file)."""
    for key, builder in builders.items():
        bin_path, idx_path = final_paths[key]
        builder.finalize(idx_path + ".partial")
        os.replace(builder.bin_path, bin_path)
        os.replace(idx_path + ".partial", idx_path)


def _log_summary(stats: PreprocessStats, dtype, input_path: str, log) -> None:
    log(f"done: {stats.documents} documents, {stats.tokens} tokens ({np.dtype(dtype).name}) in "
        f"{stats.seconds:.2f} s ({stats.documents_per_second:.0f} docs/s, "
        f"{stats.megabytes_per_second:.2f} MB/s)")
    if stats.empty_documents:
        log(f"skipped {stats.empty_documents} documents with no tokens")
    if stats.bad_lines:
        log(f"skipped {len(stats.bad_lines)} bad lines of {input_path} (first at line "
            f"{stats.bad_lines[0][0]}: {stats.bad_lines[0][1]})")
    for prefix in stats.output_prefixes.values():
        log(f"wrote {prefix}.bin and {prefix}.idx")


def _report_bad_line(stats, line_number, reason, input_path, strict, log) -> None:
    if strict:
        raise BadLineError(f"{input_path}, line {line_number}: {reason}; fix the line or run "
                           f"without --strict to skip bad lines")
    stats.bad_lines.append((line_number, reason))
    if len(stats.bad_lines) <= _MAX_REPORTED_BAD_LINES:
        log(f"WARNING: {input_path}, line {line_number}: {reason}; line skipped")
    elif len(stats.bad_lines) == _MAX_REPORTED_BAD_LINES + 1:
        log("WARNING: more bad lines; only their count is reported from here on")
