"""The packed message's wire format and its pure-Python implementation.

A packed message is one uint8 buffer: a fixed header, one entry per tensor (dtype code, ndim,
payload offset, shape) and the payloads, each aligned to ``ALIGNMENT`` bytes;
``megatron/csrc/packing.cpp`` documents the format and writes the same bytes. This module owns the
constants, the layout arithmetic (``packed_nbytes``) and the Python twin of the extension
(``pack_python`` / ``unpack_python`` / ``read_layout_python``). The public API, the C++ extension's
loading and the choice of implementation are in :mod:`.packing`.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Iterable, Sequence

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
    header, count = _read_fixed_header(buffer)
    entries = _read_entries(header, count, buffer.numel())
    _check_offsets(entries, buffer.numel())
    return entries


def _read_fixed_header(buffer: torch.Tensor) -> tuple[bytearray, int]:
    """The whole header (checked: magic, version, sizes, checksum) and the tensor count."""
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
    checked = bytearray(header[:header_nbytes])
    checked[12:16] = b"\0\0\0\0"
    if zlib.crc32(checked) != stored_crc:
        raise ValueError("packed buffer header is corrupted: header checksum mismatch")
    return checked, count


def _read_entries(header: bytearray, count: int, buffer_nbytes: int) -> list:
    """(shape, dtype, offset, nbytes) of each tensor entry of a checked header."""
    header_nbytes = len(header)
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
    return entries


def _check_offsets(entries: list, buffer_nbytes: int) -> None:
    """The payload offsets and total size must be exactly what the layout arithmetic gives."""
    _, offsets, expected_total = _layout([len(entry[0]) for entry in entries],
                                         [entry[3] for entry in entries])
    for index, (entry, expected_offset) in enumerate(zip(entries, offsets)):
        if entry[2] != expected_offset:
            raise ValueError(f"packed buffer header is corrupted: tensor {index} offset "
                             f"{entry[2]} differs from the expected {expected_offset}")
    if expected_total != buffer_nbytes:
        raise ValueError(f"packed buffer header is corrupted: the tensors need {expected_total} "
                         f"bytes but the buffer has {buffer_nbytes}")


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
