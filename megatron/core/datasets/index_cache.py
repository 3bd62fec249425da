"""On-disk cache of dataset index arrays, keyed by a hash of every input that affects them.

A cache entry is ``DIR/STEM-HASH-NAME.npy`` per array plus ``DIR/STEM-HASH-description.json``,
written last, so an entry is complete exactly when its description exists. Files are written under
temporary names and renamed, so ranks that build the same entry at the same time never read a
partial file (they at worst repeat the work). Cached arrays are memory-mapped on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from typing import Callable, Optional

import numpy as np

# Bump when the meaning of a cached index changes, so old caches are not reused.
INDEX_FORMAT_VERSION = 1


def description_hash(description: dict) -> str:
    """Stable short hash of a JSON-serialisable description."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def file_fingerprint(path: str) -> str:
    """Hash of a file's contents (cheap for .idx files, which hold lengths only)."""
    digest = hashlib.sha1()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
    directory = os.path.dirname(path)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _save_npy(path: str, array: np.ndarray) -> None:
    def write(temporary: str) -> None:
        with open(temporary, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
    _write_atomically(path, write)


def cache_paths(cache_dir: str, stem: str, description: dict, names) -> tuple[str, dict]:
    """The description path and the array paths of a cache entry."""
    key = description_hash({"format": INDEX_FORMAT_VERSION, **description})
    base = os.path.join(cache_dir, f"{stem}-{key}")
    return base + "-description.json", {name: f"{base}-{name}.npy" for name in names}


def load_or_build(cache_dir: Optional[str], stem: str, description: dict, names: tuple,
                  build: Callable[[], dict], log: Optional[Callable[[str], None]] = None) -> dict:
    """Arrays ``names`` from the cache entry for ``description``, building and saving them if absent.

    ``cache_dir`` None means no caching. When the directory cannot be written the arrays are built
    in memory and a warning says how to fix it.
    """
    if cache_dir is None:
        return build()
    description_path, array_paths = cache_paths(cache_dir, stem, description, names)
    if os.path.isfile(description_path) and all(os.path.isfile(p) for p in array_paths.values()):
        try:
            arrays = {name: np.load(path, mmap_mode="r", allow_pickle=False)
                      for name, path in array_paths.items()}
            if log:
                log(f"loaded cached {stem} indices from "
                    f"{description_path[:-len('-description.json')]}*")
            return arrays
        except (OSError, ValueError) as error:
            print(f"WARNING: unreadable dataset index cache {description_path} ({error}); "
                  f"rebuilding it", file=sys.stderr)
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in array_paths.items():
            _save_npy(path, np.ascontiguousarray(arrays[name]))
        text = json.dumps({"format": INDEX_FORMAT_VERSION, **description}, indent=2, sort_keys=True)

        def write_description(temporary: str) -> None:
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(text)
        _write_atomically(description_path, write_description)
        if log:
            log(f"saved {stem} indices to {description_path[:-len('-description.json')]}*")
    except OSError as error:
        print(f"WARNING: could not write the dataset index cache in {cache_dir} ({error}); "
              f"indices are rebuilt on every start. Pass --data-cache-path with a writable "
              f"directory to cache them.", file=sys.stderr)
    return arrays
