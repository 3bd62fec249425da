"""JSONL documents to Megatron indexed datasets (the engine of tools/preprocess_data.py).

The input is one JSONL file, or several (a glob such as ``shards/*.jsonl``, whose matches are read
in sorted order into one output). Each line is one JSON document; for every key in ``json_keys``
the text is tokenised (in ``workers`` processes, order preserved) and written as one sequence per
document to ``PREFIX_KEY_document.bin/.idx``, with the end-of-document id appended when
``append_eod``. Token dtype is uint16 when the vocabulary fits, else int32, as in Megatron.

Bad lines (invalid UTF-8 or JSON, a missing key, a value that is not a string) are reported with
their file and line number and skipped, or abort the run when ``strict``. An input that yields no
document at all (empty, every line bad, e.g. a gzip file given as JSON lines) is an error naming
each file, what was wrong with it and the fix; a compressed file is refused before any work, with
the command that decompresses it. Outputs are written under temporary names and renamed at the
end, so an interrupted run never leaves a pair that looks complete.
"""

from __future__ import annotations

import glob
import itertools
import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, data_file_path,
                                                    index_file_path, optimal_token_dtype)

# Bad lines printed one by one; past this only the count is kept.
_MAX_REPORTED_BAD_LINES = 20


# Leading bytes of compressed files people pass as JSONL by mistake: (magic, format, command).
COMPRESSED_FILE_MAGIC = (
    (b"\x1f\x8b", "gzip", "gunzip -k"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz", "unxz -k"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
)
_GLOB_CHARACTERS = "*?["


class BadLineError(ValueError):
    """A malformed input line in strict mode."""


class UnusableInputError(ValueError):
    """The input yields no document (empty, compressed, or every line bad); names file and fix."""


@dataclass
class PreprocessStats:
    """What a preprocessing run did."""

    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    bad_lines: list = field(default_factory=list)  # (input file, line number, reason)
    empty_documents: int = 0
    seconds: float = 0.0
    output_prefixes: dict = field(default_factory=dict)  # json key -> dataset prefix
    input_files: dict = field(default_factory=dict)  # input file -> InputFileStats, in read order

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes_read / 1e6 / max(self.seconds, 1e-9)

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)


@dataclass
class InputFileStats:
    """What one input file contributed (to explain a file that gave no document)."""

    lines: int = 0  # non-blank lines
    documents: int = 0
    bad_lines: int = 0
    empty_documents: int = 0
    first_bad_line: Optional[tuple] = None  # (line number, reason)


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

    def __call__(self, numbered_line: tuple[str, int, bytes]):
        source, line_number, raw = numbered_line
        return (source, line_number, len(raw), self._encode(raw))

    def _encode(self, raw: bytes):
        """Token arrays per key, or the reason (a string) the line is bad."""
        try:
            document = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            return f"invalid UTF-8 ({error.reason} at byte {error.start})"
        except json.JSONDecodeError as error:
            return f"invalid JSON ({error.msg} at column {error.colno})"
        if not isinstance(document, dict):
            return "not a JSON object"
        encoded = {}
        for key in self.json_keys:
            if key not in document:
                return f"missing key {key!r}"
            text = document[key]
            if not isinstance(text, str):
                return f"{key!r} is a {type(text).__name__}, not a string"
            try:
                ids = self.tokenizer.tokenize(text) if text else []
            except ValueError as error:  # e.g. the NullTokenizer given words instead of ids
                return f"cannot tokenise {key!r}: {error}"
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            encoded[key] = np.asarray(ids, dtype=self.dtype)
        return encoded


# The tokenizer of a worker process, built once by the pool initializer (the one piece of
# per-process state; a tokenizer is too costly to rebuild per task).
_worker_encoder: Optional[_LineEncoder] = None


def _initialize_worker(tokenizer_factory, json_keys, append_eod, dtype) -> None:
    global _worker_encoder
    _worker_encoder = _LineEncoder(tokenizer_factory(), json_keys, append_eod, dtype)


def _encode_in_worker(numbered_line):
    return _worker_encoder(numbered_line)


def _numbered_lines(input_path: str) -> Iterator[tuple[str, int, bytes]]:
    with open(input_path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield input_path, line_number, raw


def resolve_input_paths(patterns: Union[str, Sequence[str]]) -> list[str]:
    """The files ``--input`` names: each pattern is a file or a glob (its matches sorted, so the
    output does not depend on the file system's listing order); order of patterns is kept and a
    file named twice is read once. Raises FileNotFoundError naming a missing file or a glob that
    matches no file."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise ValueError("no input given; --input takes a JSONL file or a glob such as "
                         "'shards/*.jsonl'")
    paths = []
    for pattern in patterns:
        if any(character in pattern for character in _GLOB_CHARACTERS):
            matches = sorted(path for path in glob.glob(pattern, recursive=True)
                             if os.path.isfile(path))
            if not matches:
                raise FileNotFoundError(f"--input pattern {pattern!r} matches no file; check the "
                                        f"directory and the pattern")
            paths.extend(matches)
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(f"input file {pattern} does not exist; --input takes a JSONL "
                                    f"file with one JSON document per line, or a glob")
        else:
            paths.append(pattern)
    return list(dict.fromkeys(paths))


def check_not_compressed(input_path: str) -> None:
    """Raises UnusableInputError, with the command that decompresses it, for a compressed file."""
    with open(input_path, "rb") as handle:
        head = handle.read(8)
    for magic, kind, command in COMPRESSED_FILE_MAGIC:
        if head.startswith(magic):
            raise UnusableInputError(
                f"{input_path} is a {kind}-compressed file (it starts with the {kind} magic "
                f"bytes), not JSON lines; decompress it first (e.g. `{command} {input_path}`) and "
                f"pass the decompressed file to --input")


def preprocess_jsonl(input_path: Union[str, Sequence[str]], output_prefix: str,
                     tokenizer_factory: Callable,
                     json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                     workers: int = 1, log_interval: int = 1000, strict: bool = False,
                     log: Callable[[str], None] = print) -> PreprocessStats:
    """Tokenise ``input_path`` into ``PREFIX_KEY_document.bin/.idx`` per key.

    ``input_path`` is a file, a glob, or a list of them (see :func:`resolve_input_paths`); the
    files are read one after the other, in that order, into one output. Raises
    UnusableInputError (and writes nothing) when no document comes out of the input.
    ``tokenizer_factory()`` builds the tokenizer (in each worker process); it must be picklable,
    e.g. ``functools.partial(build_tokenizer, data_config, model_config)``.
    """
    input_paths = resolve_input_paths(input_path)
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    for path in input_paths:
        check_not_compressed(path)
    tokenizer = tokenizer_factory()
    dtype = optimal_token_dtype(tokenizer.vocab_size)
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)

    stats = PreprocessStats(input_files={path: InputFileStats() for path in input_paths})
    builders, final_paths = {}, {}
    for key in json_keys:
        prefix = output_prefix_for(output_prefix, key)
        stats.output_prefixes[key] = prefix
        final_paths[key] = (data_file_path(prefix), index_file_path(prefix))
        builders[key] = IndexedDatasetBuilder(data_file_path(prefix) + ".partial", dtype)

    start = time.perf_counter()
    pool = None
    lines = itertools.chain.from_iterable(_numbered_lines(path) for path in input_paths)
    try:
        if workers == 1:
            encoded_lines: Iterable = map(_LineEncoder(tokenizer, json_keys, append_eod, dtype), lines)
        else:
            pool = multiprocessing.Pool(workers, initializer=_initialize_worker,
                                        initargs=(tokenizer_factory, list(json_keys), append_eod,
                                                  dtype))
            encoded_lines = pool.imap(_encode_in_worker, lines, chunksize=64)
        for source, line_number, size, result in encoded_lines:
            stats.bytes_read += size
            file_stats = stats.input_files[source]
            file_stats.lines += 1
            if isinstance(result, str):
                _report_bad_line(stats, source, line_number, result, strict, log)
                continue
            added = _add_document(stats, builders, result)
            file_stats.documents += added
            file_stats.empty_documents += not added
            if added and log_interval and stats.documents % log_interval == 0:
                stats.seconds = time.perf_counter() - start
                log(f"processed {stats.documents} documents ({stats.documents_per_second:.0f} "
                    f"docs/s, {stats.megabytes_per_second:.2f} MB/s)")
        _check_some_documents(stats, json_keys, log)
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
    _log_summary(stats, dtype, log)
    return stats


def _why_no_documents(path: str, file_stats: InputFileStats, json_keys: Sequence[str]) -> str:
    """Why ``path`` gave no document, and what to do about it."""
    if file_stats.lines == 0:
        return f"{path} is empty (no non-blank line); give a file with one JSON document per line"
    if file_stats.bad_lines == file_stats.lines and file_stats.first_bad_line is not None:
        line_number, reason = file_stats.first_bad_line
        if reason.startswith("invalid UTF-8"):
            fix = "it looks binary (compressed, or another encoding?); convert it to UTF-8 JSONL"
        elif reason.startswith(("invalid JSON", "not a JSON object")):
            fix = 'each line must be one JSON object such as {"text": "..."}'
        elif reason.startswith("missing key"):
            fix = f"name the documents' text key with --json-keys (now {' '.join(json_keys)})"
        else:
            fix = "fix the lines or the tokenizer flags"
        return (f"every one of the {file_stats.lines} lines of {path} is invalid (first at line "
                f"{line_number}: {reason}); {fix}")
    return (f"all {file_stats.empty_documents} documents of {path} are empty (no tokens) or "
            f"invalid; check --json-keys ({' '.join(json_keys)})")


def _check_some_documents(stats: PreprocessStats, json_keys: Sequence[str], log) -> None:
    """An input with no document is an error; a file without one among others is a warning."""
    unusable = {path: _why_no_documents(path, file_stats, json_keys)
                for path, file_stats in stats.input_files.items() if file_stats.documents == 0}
    if stats.documents == 0:
        raise UnusableInputError("no document to write, nothing was written: "
                                 + "; ".join(unusable.values()))
    for reason in unusable.values():
        log(f"WARNING: no document from this input file: {reason}")


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


def _log_summary(stats: PreprocessStats, dtype, log) -> None:
    log(f"done: {stats.documents} documents, {stats.tokens} tokens ({np.dtype(dtype).name}) in "
        f"{stats.seconds:.2f} s ({stats.documents_per_second:.0f} docs/s, "
        f"{stats.megabytes_per_second:.2f} MB/s)")
    if stats.empty_documents:
        log(f"skipped {stats.empty_documents} documents with no tokens")
    if len(stats.input_files) > 1:
        log(f"read {len(stats.input_files)} input files in this order: "
            f"{', '.join(stats.input_files)}")
    if stats.bad_lines:
        path, line_number, reason = stats.bad_lines[0]
        log(f"skipped {len(stats.bad_lines)} bad lines (first: {path}, line {line_number}: "
            f"{reason})")
    for prefix in stats.output_prefixes.values():
        log(f"wrote {prefix}.bin and {prefix}.idx")


def _report_bad_line(stats, input_path, line_number, reason, strict, log) -> None:
    if strict:
        raise BadLineError(f"{input_path}, line {line_number}: {reason}; fix the line or run "
                           f"without --strict to skip bad lines")
    file_stats = stats.input_files[input_path]
    file_stats.bad_lines += 1
    if file_stats.first_bad_line is None:
        file_stats.first_bad_line = (line_number, reason)
    stats.bad_lines.append((input_path, line_number, reason))
    if len(stats.bad_lines) <= _MAX_REPORTED_BAD_LINES:
        log(f"WARNING: {input_path}, line {line_number}: {reason}; line skipped")
    elif len(stats.bad_lines) == _MAX_REPORTED_BAD_LINES + 1:
        log("WARNING: more bad lines; only their count is reported from here on")
