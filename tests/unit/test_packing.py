"""Packed p2p messages: round trips, views, C++/Python byte identity, sizes and corruption handling."""

import random
import struct
import zlib

import pytest
import torch

from megatron.core.pipeline_parallel.execution import packing

ALL_DTYPES = list(packing.DTYPE_CODES)
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5), (1, 1, 1, 1, 1, 1, 1, 3)]


@pytest.fixture(scope="session")
def cpp_packer():
    """The C++ packer: the setup.py build, else compiled once per session (JIT, cached on disk)."""
    return packing.select_packer("cpp")


@pytest.fixture(scope="session")
def python_packer():
    return packing.select_packer("python")


@pytest.fixture(params=["cpp", "python"])
def packer(request, cpp_packer, python_packer):
    return cpp_packer if request.param == "cpp" else python_packer


def make_tensor(shape, dtype, seed=0):
    """Random values of any supported dtype (bit patterns matter, not the distribution)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 3).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2 ** 40)), min(info.max, 2 ** 40)
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def as_bytes(tensor):
    """The tensor's bytes in row-major order: an exact, NaN-safe comparison for every dtype."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same(received, sent):
    assert len(received) == len(sent)
    for got, want in zip(received, sent):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(as_bytes(got), as_bytes(want))


def mixed_tensors():
    """A message like the runtime sends: activations, grads, ids, masks, scalars, odd sizes."""
    base = torch.randn(6, 10, dtype=torch.float64)
    return [
        torch.randn(4, 3, 8),
        torch.randn(8, 4).to(torch.bfloat16).t(),              # non-contiguous (transposed)
        base[::2, 1::3],                                        # strided slice with an offset
        torch.arange(5, dtype=torch.int64).expand(3, 5),        # stride-0 broadcast
        torch.tensor(2.5, dtype=torch.float16),                 # 0-dim
        torch.zeros(0, 16),                                     # zero-size
        torch.rand(13) > 0.5,                                   # bool, length not a multiple of 64
        torch.randint(0, 255, (3, 7), dtype=torch.uint8),
        torch.randn(2, 2, dtype=torch.complex64).conj(),        # lazily conjugated view
    ]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_round_trip_every_dtype_and_shape(packer, dtype):
    tensors = [make_tensor(shape, dtype, seed) for seed, shape in enumerate(SHAPES)]
    buffer = packer.pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert buffer.numel() % packing.ALIGNMENT == 0
    assert_same(packer.unpack(buffer), tensors)


def test_round_trip_mixed_non_contiguous(packer):
    tensors = mixed_tensors()
    assert not tensors[1].is_contiguous() and not tensors[2].is_contiguous()
    assert_same(packer.unpack(packer.pack(tensors)), [t.resolve_conj() for t in tensors])


def test_empty_message(packer):
    buffer = packer.pack([])
    assert buffer.numel() == packing.packed_nbytes([]) == 64
    assert packer.unpack(buffer) == []


def test_unpack_returns_aligned_views_into_the_buffer(packer):
    buffer = packer.pack(mixed_tensors())
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    views = packer.unpack(buffer)
    for view in views:
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        if view.numel() == 0:
            continue   # torch reports data_ptr() == 0 for empty tensors
        assert start <= view.data_ptr() <= end
        assert view.data_ptr() + view.numel() * view.element_size() <= end
        assert (view.data_ptr() - start) % packing.ALIGNMENT == 0
        assert view.is_contiguous()
    # Writing through the buffer is visible in the views: nothing was copied.
    first = views[0]
    buffer[first.data_ptr() - start:first.data_ptr() - start + 4].fill_(0)
    assert first.reshape(-1)[0].item() == 0.0


def test_unpack_of_a_buffer_slice(packer):
    """A receive buffer carved at an aligned position from a larger allocation still unpacks."""
    tensors = [torch.randn(3, 3, dtype=torch.float64), torch.arange(4, dtype=torch.int32)]
    message = packer.pack(tensors)
    storage = torch.zeros(128 + message.numel(), dtype=torch.uint8)
    storage[128:].copy_(message)
    assert_same(packer.unpack(storage[128:]), tensors)


def test_unpack_of_a_misaligned_slice_raises(packer):
    message = packer.pack([torch.randn(3, dtype=torch.float64)])
    storage = torch.zeros(1 + message.numel(), dtype=torch.uint8)
    storage[1:].copy_(message)
    with pytest.raises(ValueError, match="clone"):
        packer.unpack(storage[1:])


def test_cpp_and_python_write_identical_bytes(cpp_packer, python_packer):
    cases = [[], mixed_tensors(), [torch.zeros(0)], [torch.tensor(True)],
             [make_tensor(shape, dtype, 3) for dtype in ALL_DTYPES for shape in SHAPES[:4]]]
    for tensors in cases:
        cpp_bytes = cpp_packer.pack(tensors)
        assert torch.equal(cpp_bytes, python_packer.pack(tensors))
        assert torch.equal(cpp_bytes, cpp_packer.pack(tensors))   # deterministic, padding zeroed
        # Each implementation reads what the other wrote.
        assert_same(python_packer.unpack(cpp_bytes), [t.resolve_conj() for t in tensors])
        assert_same(cpp_packer.unpack(python_packer.pack(tensors)), [t.resolve_conj() for t in tensors])


def test_packed_nbytes_matches_pack(packer, cpp_packer):
    cases = [[], mixed_tensors(), [torch.zeros(0, 3)], [torch.randn(100)] * 5,
             [make_tensor((i, 3), torch.int8) for i in range(9)]]
    for tensors in cases:
        nbytes = packer.pack(tensors).numel()
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        assert packing.packed_nbytes(specs) == nbytes
        assert packer.packed_nbytes(tensors) == nbytes                 # tensors as their own specs
        assert packing.packed_nbytes([(list(s), d) for s, d in specs]) == nbytes
        cpp_module, _ = packing.load_cpp_extension()
        pairs = [(t.dim(), t.numel() * t.element_size()) for t in tensors]
        assert cpp_module.packed_nbytes(pairs) == nbytes


def test_packed_nbytes_rejects_bad_specs():
    with pytest.raises(ValueError, match="dtype"):
        packing.packed_nbytes([((2,), torch.complex32)])
    with pytest.raises(ValueError, match="shape"):
        packing.packed_nbytes([((2, -1), torch.float32)])
    with pytest.raises(ValueError, match="pair"):
        packing.packed_nbytes([(2, 3, 4)])
    with pytest.raises(ValueError, match="torch.dtype"):
        packing.packed_nbytes([((2,), "float32")])


def test_pack_rejects_bad_inputs(packer):
    with pytest.raises(ValueError, match="does not support dtype"):
        packer.pack([torch.zeros(2, dtype=torch.uint16)])
    with pytest.raises(ValueError, match="to_dense"):
        packer.pack([torch.eye(3).to_sparse()])
    with pytest.raises(ValueError, match="different devices"):
        packer.pack([torch.zeros(2), torch.zeros(2, device="meta")])
    with pytest.raises((ValueError, TypeError)):
        packer.pack([torch.zeros(2), "not a tensor"])


def test_pack_stays_out_of_autograd(packer):
    weight = torch.randn(3, 4, requires_grad=True)
    activation = weight * 2
    buffer = packer.pack([activation, weight])
    assert not buffer.requires_grad and buffer.grad_fn is None
    received = packer.unpack(buffer)
    assert all(not view.requires_grad for view in received)
    assert_same(received, [activation.detach(), weight.detach()])


def test_unpack_to_device_argument(packer):
    tensors = [torch.randn(2, 3)]
    assert_same(packer.unpack(packer.pack(tensors, device="cpu"), device="cpu"), tensors)
    assert_same(packer.unpack(packer.pack(tensors), device=torch.device("cpu")), tensors)


# --------------------------------------------------------------------------------------------
# The receiver's layout check
# --------------------------------------------------------------------------------------------

def test_expected_layout_check(packer):
    tensors = [torch.randn(4, 8), torch.zeros(4, dtype=torch.int64)]
    buffer = packer.pack(tensors)
    specs = [((4, 8), torch.float32), ((4,), torch.int64)]
    assert_same(packer.unpack(buffer, expected=specs, what="RECV_FORWARD stage 1 mb 3"), tensors)
    packer.check_layout(buffer, specs, what="RECV_FORWARD stage 1 mb 3")
    wrong = [
        [((4, 8), torch.float32)],                                  # fewer tensors
        [((4, 8), torch.float16), ((4,), torch.int64)],             # dtype
        [((8, 4), torch.float32), ((4,), torch.int64)],             # shape
        specs + [((1,), torch.bool)],                               # more tensors
    ]
    for expected in wrong:
        for check in (lambda: packer.unpack(buffer, expected=expected, what="RECV_FORWARD stage 1 mb 3"),
                      lambda: packer.check_layout(buffer, expected, what="RECV_FORWARD stage 1 mb 3")):
            with pytest.raises(ValueError, match="RECV_FORWARD stage 1 mb 3") as error:
                check()
            assert "expects" in str(error.value)


def test_read_layout(packer):
    tensors = mixed_tensors()
    layout = packer.read_layout(packer.pack(tensors))
    assert layout == [(tuple(t.shape), t.dtype) for t in tensors]


def test_module_level_functions_use_auto():
    tensors = [torch.randn(3), torch.ones(2, 2, dtype=torch.int32)]
    buffer = packing.pack(tensors)
    assert_same(packing.unpack(buffer, expected=[((3,), torch.float32), ((2, 2), torch.int32)]), tensors)
    packing.check_layout(buffer, tensors)
    with pytest.raises(ValueError, match="send stage 0"):
        packing.check_layout(buffer, tensors[:1], what="send stage 0")


# --------------------------------------------------------------------------------------------
# Corrupted and truncated buffers: always a ValueError, never a crash
# --------------------------------------------------------------------------------------------

def reference_message():
    return packing.pack_python([torch.randn(3, 4), torch.arange(6, dtype=torch.int32).view(2, 3),
                                torch.zeros(0, 2)])


def header_nbytes_of(buffer):
    return struct.unpack_from("<Q", buffer[:32].numpy().tobytes(), 16)[0]


def with_fixed_crc(buffer):
    """Recomputes the header checksum so that only the deeper structural checks can catch a change."""
    header_nbytes = header_nbytes_of(buffer)
    header = bytearray(buffer[:header_nbytes].numpy().tobytes())
    header[12:16] = b"\0\0\0\0"
    buffer[12:16] = torch.tensor(list(struct.pack("<I", zlib.crc32(header))), dtype=torch.uint8)
    return buffer


def poke(buffer, position, fmt, value, fix_crc=False):
    buffer = buffer.clone()
    buffer[position:position + struct.calcsize(fmt)] = torch.tensor(
        list(struct.pack(fmt, value)), dtype=torch.uint8)
    return with_fixed_crc(buffer) if fix_crc else buffer


ENTRY0 = packing.FIXED_HEADER_NBYTES            # first tensor entry
SHAPE0 = ENTRY0 + packing.ENTRY_NBYTES          # its shape
LAST_SHAPE = ENTRY0 + 2 * (packing.ENTRY_NBYTES + 16) + packing.ENTRY_NBYTES   # third tensor (0, 2)

CORRUPTIONS = {
    "truncated by one byte": (lambda b: b[:-1], "truncated"),
    "truncated inside the fixed header": (lambda b: b[:20], "truncated"),
    "empty buffer": (lambda b: b[:0], "truncated"),
    "trailing bytes": (lambda b: torch.cat([b, torch.zeros(64, dtype=torch.uint8)]), "trailing"),
    "bad magic": (lambda b: poke(b, 0, "<4s", b"XXXX"), "magic"),
    "future version": (lambda b: poke(b, 4, "<H", 2), "format version"),
    "bad alignment field": (lambda b: poke(b, 6, "<H", 16), "alignment"),
    "flipped shape byte": (lambda b: poke(b, SHAPE0, "<q", 5), "checksum"),
    "flipped dtype byte": (lambda b: poke(b, ENTRY0, "<B", 2), "checksum"),
    "flipped checksum": (lambda b: poke(b, 12, "<I", 12345), "checksum"),
    "huge count": (lambda b: poke(b, 8, "<I", 2 ** 31, fix_crc=True), "header size"),
    "huge header size": (lambda b: poke(b, 16, "<Q", 2 ** 63, fix_crc=True), "header size"),
    "unknown dtype code": (lambda b: poke(b, ENTRY0, "<B", 99, fix_crc=True), "unknown dtype"),
    "too many dims": (lambda b: poke(b, ENTRY0 + 1, "<B", 200, fix_crc=True), "dims"),
    "reserved bytes set": (lambda b: poke(b, ENTRY0 + 3, "<B", 1, fix_crc=True), "reserved"),
    "negative dimension": (lambda b: poke(b, SHAPE0, "<q", -3, fix_crc=True), "negative"),
    "dimension larger than the buffer": (lambda b: poke(b, SHAPE0, "<q", 2 ** 62, fix_crc=True),
                                         "does not fit"),
    "offset moved": (lambda b: poke(b, ENTRY0 + 8, "<Q", 1 << 40, fix_crc=True), "offset"),
    "larger first shape": (lambda b: poke(b, SHAPE0, "<q", 5, fix_crc=True), "offset"),
    "larger last shape": (lambda b: poke(b, LAST_SHAPE, "<q", 8, fix_crc=True), "need"),
    "ndim changed": (lambda b: poke(b, ENTRY0 + 1, "<B", 1, fix_crc=True), "corrupted"),
    "all zeros": (lambda b: torch.zeros_like(b), "magic"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_raises_the_same_clear_error_in_both(kind, cpp_packer, python_packer):
    corrupt, message = CORRUPTIONS[kind]
    buffer = corrupt(reference_message())
    errors = []
    for packer in (cpp_packer, python_packer):
        for call in (packer.unpack, packer.read_layout):
            with pytest.raises(ValueError, match=message) as error:
                call(buffer)
            errors.append(str(error.value))
    assert len(set(errors)) == 1, errors     # the twins explain a defect identically


def test_wrong_buffer_type_raises(packer):
    message = reference_message()
    for bad, text in [(message.float(), "uint8"), (message.view(-1, 8), "1-D"),
                      (torch.cat([message, message])[::2], "contiguous"), ([1, 2, 3], "torch.Tensor")]:
        with pytest.raises(ValueError, match=text):
            packer.unpack(bad)


def test_every_truncation_and_header_byte_flip_raises(cpp_packer, python_packer):
    message = reference_message()
    header_nbytes = header_nbytes_of(message)
    for length in range(message.numel()):
        for packer in (cpp_packer, python_packer):
            with pytest.raises(ValueError):
                packer.unpack(message[:length].clone())
    rng = random.Random(0)
    for position in range(header_nbytes):
        corrupted = message.clone()
        corrupted[position] ^= 1 << rng.randrange(8)
        for packer in (cpp_packer, python_packer):
            with pytest.raises(ValueError):
                packer.unpack(corrupted)


def test_random_garbage_never_crashes(cpp_packer, python_packer):
    rng = torch.Generator().manual_seed(0)
    for size in [0, 1, 31, 32, 64, 200, 4096, 5000]:
        for _ in range(20):
            garbage = torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8)
            prefix = min(4, size)   # a valid magic, so that the deeper checks are exercised too
            garbage[:prefix] = torch.tensor(list(b"MCPK")[:prefix], dtype=torch.uint8)
            for packer in (cpp_packer, python_packer):
                with pytest.raises(ValueError):
                    packer.unpack(garbage)
