"""One packed message per peer: pack/unpack of tensor lists and the choice of implementation.

This module owns the public API of point-to-point packing (see docs/packing.md):

- ``pack(tensors) -> uint8 buffer`` and ``unpack(buffer, device=None, expected=None, what=None)``,
  which returns views into the buffer (no copies);
- ``packed_nbytes(specs)``: exact message size from ``[(shape, dtype), ...]``, so a receiver can post
  an ``irecv`` of the right size before the message arrives;
- ``check_layout(buffer, expected, what)``: the receiver's check that the header matches the schedule;
- ``select_packer(mode)`` for ``--p2p-packing {auto,cpp,python,off}``, returning a ``Packer`` whose
  ``name`` and ``reason`` say which implementation is active and why;
- the pure-Python implementation, which writes bytes identical to the C++ extension in
  ``megatron/csrc/packing.cpp`` (that file documents the binary format), and the loader of that
  extension (built by setup.py, else compiled on first use, cached per process by ``lru_cache``);
- ``measure_pack_unpack``: the pack + unpack micro-benchmark used by benchmarks/.
"""

from __future__ import annotations

import functools
import importlib
import shutil
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

FORMAT_VERSION = 1
ALIGNMENT = 64
MAGIC = b"MCPK"
FIXED_HEADER_NBYTES = 32
ENTRY_NBYTES = 16
MAX_DIMS = 64
PACKING_MODES = ("auto", "cpp", "python", "off")

# Wire codes of the supported dtypes; they match dtype_table() in packing.cpp. Never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
    torch.uint8: 5, torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9,
    torch.bool: 10, torch.complex64: 11, torch.complex128: 12,
    torch.float8_e4m3fn: 13, torch.float8_e5m2: 14,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

_FIXED_HEADER = struct.Struct("<4sHHIIQQ")   # magic, version, alignment, count, crc, header bytes, total
_ENTRY = struct.Struct("<BB6xQ")             # dtype code, ndim, reserved, payload offset

EXTENSION_MODULE = "megatron._packing_cpp"
JIT_MODULE = "megatron_packing_jit"
SOURCE_PATH = Path(__file__).resolve().parents[3] / "csrc" / "packing.cpp"

TensorSpec = tuple[tuple[int, ...], torch.dtype]


# --------------------------------------------------------------------------------------------
# Layout arithmetic shared by both implementations
# --------------------------------------------------------------------------------------------

def _align_up(value: int) -> int:
    return (value + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise ValueError(f"p2p packing does not support dtype {dtype}; convert the tensor to a "
                         f"supported dtype ({supported}) or send it unpacked") from None


def _layout(ndims: Sequence[int], nbytes: Sequence[int]) -> tuple[int, list[int], int]:
    """(header bytes, payload offsets, total bytes) of a message; see packing.cpp for the format."""
    header_nbytes = FIXED_HEADER_NBYTES + sum(ENTRY_NBYTES + 8 * ndim for ndim in ndims)
    cursor = _align_up(header_nbytes)
    offsets = []
    for size in nbytes:
        offsets.append(cursor)
        cursor += _align_up(size)
    return header_nbytes, offsets, cursor


def _normalize_specs(specs: Iterable[Any]) -> list[TensorSpec]:
    """Accepts (shape, dtype) pairs or tensors; returns (shape tuple, dtype) pairs."""
    normalized = []
    for index, spec in enumerate(specs):
        if isinstance(spec, torch.Tensor):
            normalized.append((tuple(spec.shape), spec.dtype))
            continue
        try:
            shape, dtype = spec
            shape = tuple(int(size) for size in shape)
        except (TypeError, ValueError):
            raise ValueError(f"tensor spec {index} must be a (shape, dtype) pair or a tensor, "
                             f"got {spec!r}") from None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor spec {index} has dtype {dtype!r}; pass a torch.dtype")
        if any(size < 0 for size in shape) or len(shape) > MAX_DIMS:
            raise ValueError(f"tensor spec {index} has an invalid shape {shape}")
        normalized.append((shape, dtype))
    return normalized


def _spec_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def packed_nbytes(specs: Iterable[Any]) -> int:
    """Exact byte size of the message that ``pack`` produces for ``[(shape, dtype), ...]``.

    Tensors may stand in for their own (shape, dtype). The receiver uses this to allocate the
    ``irecv`` buffer before the message arrives; it does not depend on the implementation.
    """
    normalized = _normalize_specs(specs)
    for _, dtype in normalized:
        _dtype_code(dtype)
    _, _, total = _layout([len(shape) for shape, _ in normalized],
                          [_spec_nbytes(shape, dtype) for shape, dtype in normalized])
    return total


# --------------------------------------------------------------------------------------------
# Pure-Python implementation (byte-identical to packing.cpp)
# --------------------------------------------------------------------------------------------

def _target_device(tensors: Sequence[torch.Tensor], device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if not tensors:
        return torch.device("cpu")
    first = tensors[0].device
    for tensor in tensors[1:]:
        if tensor.device != first:
            raise ValueError(f"tensors passed to pack() are on different devices ({first} and "
                             f"{tensor.device}); move them to one device or pass device=")
    return first


def pack_python(tensors: Sequence[torch.Tensor], device=None) -> torch.Tensor:
    """Pure-Python ``pack``: one uint8 buffer holding the header and every tensor's bytes."""
    tensors = list(tensors)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {index} passed to pack() is a {type(tensor).__name__}, "
                             f"not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {index} is not a dense strided tensor; call .to_dense() "
                             f"before packing")
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"tensor {index} has too many dims for packing")
    target = _target_device(tensors, device)
    codes = [_dtype_code(tensor.dtype) for tensor in tensors]
    nbytes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    header_nbytes, offsets, total = _layout([tensor.dim() for tensor in tensors], nbytes)
    header_region = _align_up(header_nbytes)

    header = bytearray(header_region)
    _FIXED_HEADER.pack_into(header, 0, MAGIC, FORMAT_VERSION, ALIGNMENT, len(tensors), 0,
                            header_nbytes, total)
    position = FIXED_HEADER_NBYTES
    for tensor, code, offset in zip(tensors, codes, offsets):
        _ENTRY.pack_into(header, position, code, tensor.dim(), offset)
        position += ENTRY_NBYTES
        struct.pack_into(f"<{tensor.dim()}q", header, position, *tensor.shape)
        position += 8 * tensor.dim()
    struct.pack_into("<I", header, 12, zlib.crc32(memoryview(header)[:header_nbytes]))

    with torch.no_grad():  # a transport buffer must not enter the autograd graph
        buffer = torch.empty(total, dtype=torch.uint8, device=target)
        buffer[:header_region].copy_(torch.frombuffer(header, dtype=torch.uint8))
        for tensor, offset, size in zip(tensors, offsets, nbytes):
            if size > 0:
                buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            padding = _align_up(size) - size
            if padding > 0:  # zeroed so that the bytes are deterministic
                buffer[offset + size:offset + size + padding].zero_()
    return buffer


def _check_buffer(buffer) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"packed buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"packed buffer must be a 1-D uint8 tensor, got {buffer.dtype} with "
                         f"{buffer.dim()} dims; pass the tensor returned by pack()")
    if buffer.numel() > 1 and buffer.stride(0) != 1:
        raise ValueError("packed buffer must be contiguous; pass buffer.contiguous()")


def _host_bytes(buffer: torch.Tensor, nbytes: int) -> bytes:
    return buffer[:nbytes].cpu().numpy().tobytes()


def _parse_header_python(buffer: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, int, int]]:
    """Validated (shape, dtype, offset, nbytes) per tensor; every defect raises ValueError."""
    _check_buffer(buffer)
    buffer_nbytes = buffer.numel()
    if buffer_nbytes < FIXED_HEADER_NBYTES:
        raise ValueError(f"packed buffer is truncated: it has {buffer_nbytes} bytes but the fixed "
                         f"header needs {FIXED_HEADER_NBYTES}; check that the receive buffer was "
                         f"sized with packed_nbytes()")
    header = _host_bytes(buffer, min(buffer_nbytes, 4096))
    magic, version, alignment, count, stored_crc, header_nbytes, total = \
        _FIXED_HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise ValueError("packed buffer has a bad magic number (expected 'MCPK'): it is not a "
                         "packed message or it is corrupted")
    if version != FORMAT_VERSION:
        raise ValueError(f"packed buffer has format version {version} but this build reads "
                         f"version {FORMAT_VERSION}; sender and receiver must run the same "
                         f"megatron version")
    if alignment != ALIGNMENT:
        raise ValueError(f"packed buffer header is corrupted: alignment field is {alignment}, "
                         f"expected {ALIGNMENT}")
    if total != buffer_nbytes:
        raise ValueError(f"packed buffer is truncated or has trailing bytes: header says {total} "
                         f"bytes, buffer has {buffer_nbytes}; size the receive buffer with "
                         f"packed_nbytes() and pass exactly that many bytes")
    if not FIXED_HEADER_NBYTES + ENTRY_NBYTES * count <= header_nbytes <= buffer_nbytes:
        raise ValueError(f"packed buffer header is corrupted: header size {header_nbytes} is "
                         f"inconsistent with {count} tensors in a {buffer_nbytes}-byte buffer")
    if header_nbytes > len(header):
        header = _host_bytes(buffer, header_nbytes)
    header = bytearray(header[:header_nbytes])
    header[12:16] = b"\0\0\0\0"
    if zlib.crc32(header) != stored_crc:
        raise ValueError("packed buffer header is corrupted: header checksum mismatch")

    entries = []
    position = FIXED_HEADER_NBYTES
    for index in range(count):
        where = f"packed buffer header is corrupted: tensor {index} "
        if position + ENTRY_NBYTES > header_nbytes:
            raise ValueError(where + "entry runs past the header")
        if any(header[position + 2:position + 8]):
            raise ValueError(where + "has non-zero reserved bytes")
        code, ndim, offset = _ENTRY.unpack_from(header, position)
        if code not in DTYPES_BY_CODE:
            raise ValueError(where + f"has unknown dtype code {code}")
        if ndim > MAX_DIMS:
            raise ValueError(where + f"has {ndim} dims (limit {MAX_DIMS})")
        position += ENTRY_NBYTES
        if position + 8 * ndim > header_nbytes:
            raise ValueError(where + "shape runs past the header")
        shape = struct.unpack_from(f"<{ndim}q", header, position)
        position += 8 * ndim
        negative = [size for size in shape if size < 0]
        if negative:
            raise ValueError(where + f"has a negative dimension {negative[0]}")
        dtype = DTYPES_BY_CODE[code]
        nbytes = _spec_nbytes(shape, dtype)
        if nbytes > buffer_nbytes:
            raise ValueError(where + f"shape {tuple(shape)} does not fit in the buffer")
        entries.append((tuple(shape), dtype, offset, nbytes))
    if position != header_nbytes:
        raise ValueError("packed buffer header is corrupted: entries do not fill the header "
                         "exactly")
    _, offsets, expected_total = _layout([len(entry[0]) for entry in entries],
                                         [entry[3] for entry in entries])
    for index, (entry, expected_offset) in enumerate(zip(entries, offsets)):
        if entry[2] != expected_offset:
            raise ValueError(f"packed buffer header is corrupted: tensor {index} offset "
                             f"{entry[2]} differs from the expected {expected_offset}")
    if expected_total != buffer_nbytes:
        raise ValueError(f"packed buffer header is corrupted: the tensors need {expected_total} "
                         f"bytes but the buffer has {buffer_nbytes}")
    return entries


def unpack_python(buffer: torch.Tensor, device=None) -> list[torch.Tensor]:
    """Pure-Python ``unpack``: views into ``buffer`` (moved to ``device`` first if given)."""
    _check_buffer(buffer)
    if device is not None and buffer.device != torch.device(device):
        buffer = buffer.to(device)
    views = []
    for shape, dtype, offset, nbytes in _parse_header_python(buffer):
        if (buffer.storage_offset() + offset) % dtype.itemsize != 0:
            raise ValueError(f"packed buffer starts at storage byte offset "
                             f"{buffer.storage_offset()}, which is not aligned for "
                             f"{str(dtype).replace('torch.', '')}; unpack buffer.clone() instead")
        views.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
    return views


def read_layout_python(buffer: torch.Tensor) -> list[TensorSpec]:
    """Validated ``[(shape, dtype), ...]`` of a packed buffer, without creating views."""
    return [(shape, dtype) for shape, dtype, _, _ in _parse_header_python(buffer)]


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


@functools.lru_cache(maxsize=None)
def load_jit_extension(verbose: bool = False):
    """Compiles packing.cpp with torch.utils.cpp_extension.load (cached on disk by torch, and
    per process by lru_cache). Raises RuntimeError with the reason when it cannot."""
    if not SOURCE_PATH.is_file():
        raise RuntimeError(f"the C++ source {SOURCE_PATH} is missing from this installation")
    from torch.utils import cpp_extension
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) found to compile {SOURCE_PATH.name}; "
                           f"install g++ or reinstall with `pip install --no-build-isolation -e .`")
    try:
        module = cpp_extension.load(name=JIT_MODULE, sources=[str(SOURCE_PATH)],
                                    extra_cflags=["-O3"], verbose=verbose)
    except Exception as error:  # compiler errors surface as many exception types
        raise RuntimeError(f"compiling {SOURCE_PATH.name} failed: {error}") from error
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
    _pack: Optional[Callable] = field(default=None, repr=False, compare=False)
    _unpack: Optional[Callable] = field(default=None, repr=False, compare=False)
    _read_layout: Optional[Callable] = field(default=None, repr=False, compare=False)

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
    rows = []
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
