"""One packed message per peer: pack/unpack of tensor lists and the choice of implementation.

This module owns the public API of point-to-point packing (see docs/packing.md):

- ``pack(tensors) -> uint8 buffer`` and ``unpack(buffer, device=None, expected=None, what=None)``,
  which returns views into the buffer (no copies);
- ``packed_nbytes(specs)``: exact message size from ``[(shape, dtype), ...]``, so a receiver can post
  an ``irecv`` of the right size before the message arrives;
- ``check_layout(buffer, expected, what)``: the receiver's check that the header matches the schedule;
- ``select_packer(mode)`` for ``--p2p-packing {auto,cpp,python,off}``, returning a ``Packer`` whose
  ``name`` and ``reason`` say which implementation is active and why;
- the pure-Python implementation (in :mod:`.wire_format`, re-exported here), which writes bytes
  identical to the C++ extension in ``megatron/csrc/packing.cpp`` (that file documents the binary
  format), and the loader of that extension (built by setup.py, else compiled on first use by one
  process at a time under the lock of :mod:`.build_lock`, cached per process by ``lru_cache``);
- ``measure_pack_unpack``: the pack + unpack micro-benchmark used by benchmarks/.
"""

from __future__ import annotations

import functools
import importlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from . import build_lock
from .wire_format import (  # noqa: F401  (re-exported: packing's public API)
    ALIGNMENT, DTYPES_BY_CODE, DTYPE_CODES, ENTRY_NBYTES, FIXED_HEADER_NBYTES, FORMAT_VERSION,
    PACKING_MODES,
    TensorSpec, _normalize_specs, pack_python, packed_nbytes, read_layout_python, unpack_python)

EXTENSION_MODULE = "megatron._packing_cpp"
JIT_MODULE = "megatron_packing_jit"
SOURCE_PATH = Path(__file__).resolve().parents[3] / "csrc" / "packing.cpp"
# In the JIT build directory: our lock (owner recorded, see build_lock) and torch's own FileBaton.
JIT_BUILD_LOCK_NAME = "megatron_build.lock"
TORCH_BATON_NAME = "lock"

# --------------------------------------------------------------------------------------------
# The C++ extension: built by setup.py, else compiled on first use
# --------------------------------------------------------------------------------------------

def _check_extension(module) -> None:
    """Raises RuntimeError when a loaded extension does not write this module's format."""
    if module.format_version() != FORMAT_VERSION or module.alignment() != ALIGNMENT:
        raise RuntimeError(f"{module.__name__} writes format {module.format_version()} "
                           f"(alignment {module.alignment()}) but packing.py expects "
                           f"{FORMAT_VERSION} ({ALIGNMENT}); it is a stale build")
    codes = {code: name for code, name in module.dtype_codes()}
    expected = {code: str(dtype).replace("torch.", "") for dtype, code in DTYPE_CODES.items()}
    if codes != expected:
        raise RuntimeError(f"{module.__name__} has different dtype codes; it is a stale build")


def jit_build_directory() -> Path:
    """Where torch compiles and caches the JIT extension: ``$TORCH_EXTENSIONS_DIR/NAME``, else
    ``~/.cache/torch_extensions/py3XX_cpu/NAME`` (torch's choice, so an existing cache is
    reused; ``_get_build_directory`` is private but unchanged since torch 1.x, and creates the
    directory)."""
    from torch.utils import cpp_extension
    return Path(cpp_extension._get_build_directory(JIT_MODULE, verbose=False))


def _check_no_torch_baton(build_directory: Path) -> None:
    """torch's own lock must be absent while we hold ours: every process that builds this
    extension takes our lock first, so a leftover file comes from a build that was killed, and
    ``cpp_extension.load`` would wait on it forever."""
    baton = build_directory / TORCH_BATON_NAME
    if baton.exists():
        raise RuntimeError(f"torch's build lock {baton} is left over from an interrupted "
                           f"compilation of {SOURCE_PATH.name} (no process holds "
                           f"{build_directory / JIT_BUILD_LOCK_NAME}); torch would wait on it "
                           f"forever: delete it (rm {baton}) and start again")


@functools.lru_cache(maxsize=None)
def load_jit_extension(verbose: bool = False,
                       lock_timeout_s: float = build_lock.DEFAULT_TIMEOUT_S):
    """Compiles packing.cpp with torch.utils.cpp_extension.load (cached on disk by torch, and
    per process by lru_cache). Raises RuntimeError with the reason when it cannot.

    One process at a time builds, holding ``JIT_BUILD_LOCK_NAME`` in the build directory; the
    others wait (up to ``lock_timeout_s``) and then load the cached build. A stale lock raises a
    RuntimeError naming the file to delete (see :mod:`.build_lock`)."""
    if not SOURCE_PATH.is_file():
        raise RuntimeError(f"the C++ source {SOURCE_PATH} is missing from this installation")
    from torch.utils import cpp_extension
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) found to compile {SOURCE_PATH.name}; "
                           f"install g++ or reinstall with `pip install --no-build-isolation -e .`")
    build_directory = jit_build_directory()

    def compile_and_load():
        _check_no_torch_baton(build_directory)
        try:
            return cpp_extension.load(name=JIT_MODULE, sources=[str(SOURCE_PATH)],
                                      extra_cflags=["-O3"], build_directory=str(build_directory),
                                      verbose=verbose)
        except Exception as error:  # compiler errors surface as many exception types
            raise RuntimeError(f"compiling {SOURCE_PATH.name} failed: {error}") from error

    module = build_lock.run_exclusively(
        build_directory / JIT_BUILD_LOCK_NAME, compile_and_load,
        what=f"compiling {SOURCE_PATH.name} in {build_directory}", timeout_s=lock_timeout_s,
        log=lambda message: print(message, flush=True))
    _check_extension(module)
    return module


@functools.lru_cache(maxsize=None)
def load_cpp_extension(allow_jit: bool = True) -> tuple[Any, str]:
    """(module, how it was loaded) for the C++ extension; prefers the setup.py build.

    Raises RuntimeError naming every reason when neither the prebuilt module nor (if
    ``allow_jit``) a JIT compilation is usable. Cached per process.
    """
    try:
        module = importlib.import_module(EXTENSION_MODULE)
        _check_extension(module)
        return module, f"{EXTENSION_MODULE} built by setup.py"
    except (ImportError, RuntimeError) as error:
        prebuilt_problem = f"prebuilt {EXTENSION_MODULE} unusable ({error})"
    if not allow_jit:
        raise RuntimeError(prebuilt_problem + "; compilation at first use is disabled")
    try:
        return load_jit_extension(), f"compiled on first use (JIT), {prebuilt_problem}"
    except RuntimeError as error:
        raise RuntimeError(f"{prebuilt_problem}; {error}") from error


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Packer:
    """One packing implementation: ``name`` is "cpp", "python" or "off"; ``reason`` says why it is
    active (for the log). With "off", ``pack``/``unpack`` raise: send tensors one by one."""

    name: str
    reason: str
    # the implementation's functions (None when off: the public methods raise before calling them)
    _pack: Any = field(default=None, repr=False, compare=False)
    _unpack: Any = field(default=None, repr=False, compare=False)
    _read_layout: Any = field(default=None, repr=False, compare=False)

    @property
    def enabled(self) -> bool:
        return self.name != "off"

    def describe(self) -> str:
        """The line the training log prints about the active packing."""
        return f"p2p packing: {self.name} ({self.reason})"

    def _require_enabled(self) -> None:
        if not self.enabled:
            raise RuntimeError("p2p packing is off (--p2p-packing off): send tensors individually "
                               "or select auto, cpp or python")

    def pack(self, tensors: Sequence[torch.Tensor], device=None) -> torch.Tensor:
        """Packs ``tensors`` (any supported dtype, contiguous or not) into one uint8 buffer on
        ``device`` (default: the tensors' common device, CPU for an empty list)."""
        self._require_enabled()
        return self._pack(list(tensors), None if device is None else torch.device(device))

    def unpack(self, buffer: torch.Tensor, device=None, expected: Optional[Iterable[Any]] = None,
               what: str = "packed message") -> list[torch.Tensor]:
        """Views into ``buffer`` (moved to ``device`` first if given). With ``expected``
        (``[(shape, dtype), ...]``) a layout mismatch raises a ValueError naming ``what``."""
        self._require_enabled()
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(f"packed buffer must be a torch.Tensor, got {type(buffer).__name__}")
        views = self._unpack(buffer, None if device is None else torch.device(device))
        if expected is not None:
            _compare_layout([(tuple(view.shape), view.dtype) for view in views], expected, what)
        return views

    def read_layout(self, buffer: torch.Tensor) -> list[TensorSpec]:
        """Validated ``[(shape, dtype), ...]`` from the header, without creating views."""
        self._require_enabled()
        return self._read_layout(buffer)

    def check_layout(self, buffer: torch.Tensor, expected: Iterable[Any],
                     what: str = "packed message") -> None:
        """Raises ValueError naming ``what`` when the header does not hold ``expected``."""
        _compare_layout(self.read_layout(buffer), expected, what)

    @staticmethod
    def packed_nbytes(specs: Iterable[Any]) -> int:
        """Exact message size for ``[(shape, dtype), ...]`` (same for every implementation)."""
        return packed_nbytes(specs)


def _describe_specs(specs: Sequence[TensorSpec]) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {str(dtype).replace('torch.', '')}"
                           for shape, dtype in specs) + "]"


def _compare_layout(actual: Sequence[TensorSpec], expected: Iterable[Any], what: str) -> None:
    expected = _normalize_specs(expected)
    if list(actual) != expected:
        raise ValueError(f"{what}: the received packed message holds {len(actual)} tensors "
                         f"{_describe_specs(actual)} but the receiver expects {len(expected)} "
                         f"{_describe_specs(expected)}; sender and receiver schedules disagree")


def _cpp_packer(allow_jit: bool) -> Packer:
    module, how = load_cpp_extension(allow_jit)

    def read_layout(buffer):
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(f"packed buffer must be a torch.Tensor, got {type(buffer).__name__}")
        return [(tuple(shape), DTYPES_BY_CODE[code]) for shape, code, _ in module.read_layout(buffer)]

    return Packer("cpp", how, module.pack, module.unpack, read_layout)


def _python_packer(reason: str) -> Packer:
    return Packer("python", reason, pack_python, unpack_python, read_layout_python)


def select_packer(mode: str = "auto", allow_jit: bool = True) -> Packer:
    """The packer for ``--p2p-packing mode``.

    ``auto`` prefers the C++ extension (prebuilt, else compiled on first use when ``allow_jit``)
    and falls back to Python with the reason in ``Packer.reason``; ``cpp`` raises RuntimeError
    when the extension cannot be loaded; ``python`` and ``off`` never touch the extension.
    """
    if mode not in PACKING_MODES:
        raise ValueError(f"unknown p2p packing mode {mode!r}; choose one of {', '.join(PACKING_MODES)}")
    if mode == "off":
        return Packer("off", "--p2p-packing off: one message per tensor")
    if mode == "python":
        return _python_packer("selected with --p2p-packing python")
    try:
        return _cpp_packer(allow_jit)
    except RuntimeError as error:
        if mode == "cpp":
            raise RuntimeError(f"--p2p-packing cpp: the C++ extension is unavailable: {error}. "
                               f"Fix: `pip install --no-build-isolation -e .` with torch installed "
                               f"and a C++ compiler present, or use --p2p-packing auto/python"
                               ) from error
        return _python_packer(f"C++ extension unavailable, using Python: {error}")


# Module-level conveniences use the automatically selected implementation.

def pack(tensors: Sequence[torch.Tensor], device=None) -> torch.Tensor:
    """``select_packer("auto").pack``: packs tensors into one uint8 buffer."""
    return select_packer("auto").pack(tensors, device)


def unpack(buffer: torch.Tensor, device=None, expected: Optional[Iterable[Any]] = None,
           what: str = "packed message") -> list[torch.Tensor]:
    """``select_packer("auto").unpack``: views into a packed buffer, optionally checked."""
    return select_packer("auto").unpack(buffer, device, expected, what)


def check_layout(buffer: torch.Tensor, expected: Iterable[Any], what: str = "packed message") -> None:
    """Raises ValueError naming ``what`` when the buffer's header does not hold ``expected``."""
    select_packer("auto").check_layout(buffer, expected, what)


# --------------------------------------------------------------------------------------------
# Micro-benchmark
# --------------------------------------------------------------------------------------------

def measure_pack_unpack(packer: Packer, num_tensors: int, tensor_nbytes: int,
                        dtype: torch.dtype = torch.float32, repeats: int = 20,
                        device="cpu") -> dict[str, float]:
    """Times ``packer.pack`` + ``packer.unpack`` of ``num_tensors`` tensors of ``tensor_nbytes``
    bytes each; returns the best-of-``repeats`` seconds per message, MB/s and microseconds per MB
    (MB = 1e6 bytes of payload). One warm-up round is not timed."""
    numel = max(1, tensor_nbytes // dtype.itemsize)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(numel, generator=generator).to(dtype=dtype, device=device)
               for _ in range(num_tensors)]
    payload_mb = num_tensors * numel * dtype.itemsize / 1e6
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    packer.unpack(packer.pack(tensors))
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        packer.unpack(packer.pack(tensors))
        synchronize()
        best = min(best, time.perf_counter() - start)
    return {"seconds_per_message": best, "payload_mb": payload_mb,
            "mb_per_second": payload_mb / best, "microseconds_per_mb": best * 1e6 / payload_mb}


def microbenchmark_table(modes: Sequence[str] = ("cpp", "python"),
                         cases: Sequence[tuple[int, int]] = ((1, 4 << 20), (8, 512 << 10),
                                                             (64, 16 << 10), (16, 1 << 10)),
                         repeats: int = 20) -> list[dict[str, Any]]:
    """Rows ``{mode, num_tensors, tensor_nbytes, mb_per_second, microseconds_per_mb,
    microseconds_per_message}`` measured side by side; modes that cannot load are skipped with
    a row holding ``error``."""
    rows: list[dict[str, Any]] = []
    for mode in modes:
        try:
            packer = select_packer(mode)
        except RuntimeError as error:
            rows.append({"mode": mode, "error": str(error)})
            continue
        for num_tensors, tensor_nbytes in cases:
            result = measure_pack_unpack(packer, num_tensors, tensor_nbytes, repeats=repeats)
            rows.append({"mode": packer.name, "num_tensors": num_tensors,
                         "tensor_nbytes": tensor_nbytes, "mb_per_second": result["mb_per_second"],
                         "microseconds_per_mb": result["microseconds_per_mb"],
                         "microseconds_per_message": result["seconds_per_message"] * 1e6})
    return rows
