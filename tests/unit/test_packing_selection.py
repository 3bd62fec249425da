"""Choosing the packing implementation: modes, fallbacks with reasons, the loader, the micro-benchmark."""

import types

import pytest
import torch

from megatron.core import config as config_module
from megatron.core.pipeline_parallel.execution import packing


def test_config_flag_matches_the_modes():
    parallel = config_module.ParallelConfig()
    assert parallel.p2p_packing == "auto"
    choices = next(f for f in config_module.dataclasses.fields(parallel)
                   if f.name == "p2p_packing").metadata["choices"]
    assert tuple(choices) == packing.PACKING_MODES


def test_auto_selects_the_cpp_extension():
    """The installed package (setup.py build) or a first-use compilation must provide C++."""
    packer = packing.select_packer("auto")
    assert packer.name == "cpp", packer.reason
    assert packer.describe().startswith("p2p packing: cpp (")


def test_python_and_off_modes():
    python = packing.select_packer("python")
    assert python.name == "python" and python.enabled
    off = packing.select_packer("off")
    assert off.name == "off" and not off.enabled
    with pytest.raises(RuntimeError, match="packing is off"):
        off.pack([torch.zeros(1)])
    with pytest.raises(RuntimeError, match="packing is off"):
        off.unpack(python.pack([torch.zeros(1)]))
    assert off.packed_nbytes([((1,), torch.float32)]) == 128


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="auto, cpp, python, off"):
        packing.select_packer("fast")


def test_cpp_unavailable_fallbacks(monkeypatch):
    def unavailable(allow_jit=True):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(packing, "load_cpp_extension", unavailable)
    with pytest.raises(RuntimeError, match="--p2p-packing cpp.*no compiler here.*pip install"):
        packing.select_packer("cpp")
    auto = packing.select_packer("auto")
    assert auto.name == "python"
    assert "no compiler here" in auto.reason and "no compiler here" in auto.describe()


def test_missing_prebuilt_module_without_jit_raises(monkeypatch):
    monkeypatch.setattr(packing, "EXTENSION_MODULE", "megatron._no_such_packing_module")
    with pytest.raises(RuntimeError, match="_no_such_packing_module.*disabled"):
        packing.load_cpp_extension.__wrapped__(allow_jit=False)


@pytest.mark.distributed  # starts a process
def test_missing_prebuilt_module_falls_back_to_jit(monkeypatch):
    """The first-use compilation path (slow the first time on a machine, cached by torch after)."""
    monkeypatch.setattr(packing, "EXTENSION_MODULE", "megatron._no_such_packing_module")
    module, how = packing.load_cpp_extension.__wrapped__(allow_jit=True)
    assert "JIT" in how and "_no_such_packing_module" in how
    tensors = [torch.randn(3, 5).t(), torch.arange(4)]
    assert torch.equal(module.pack(tensors, None), packing.pack_python(tensors))


def test_missing_compiler_is_reported(monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: "no-such-c++-compiler")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        packing.load_jit_extension.__wrapped__()


def test_stale_extension_is_rejected():
    good, _ = packing.load_cpp_extension()
    stale = types.SimpleNamespace(__name__="stale", format_version=lambda: 0,
                                  alignment=good.alignment, dtype_codes=good.dtype_codes)
    with pytest.raises(RuntimeError, match="stale build"):
        packing._check_extension(stale)
    renumbered = types.SimpleNamespace(__name__="renumbered", format_version=good.format_version,
                                       alignment=good.alignment,
                                       dtype_codes=lambda: [(1, "float64"), (2, "float32")])
    with pytest.raises(RuntimeError, match="stale build"):
        packing._check_extension(renumbered)
    packing._check_extension(good)


def test_microbenchmark_reports_both_implementations():
    rows = packing.microbenchmark_table(cases=((2, 4096),), repeats=2)
    assert [row["mode"] for row in rows] == ["cpp", "python"]
    for row in rows:
        assert row["mb_per_second"] > 0 and row["microseconds_per_message"] > 0
        assert row["microseconds_per_mb"] == pytest.approx(1e6 / row["mb_per_second"])
