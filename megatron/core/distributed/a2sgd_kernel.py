"""A2SGD's fused CPU float32 passes (megatron/csrc/a2sgd.cpp) and when they are used.

The torch-ops arithmetic of :mod:`.a2sgd` makes about nine passes over the gradient per step; the
C++ kernel makes two, with the same float32 element arithmetic:

* :func:`corrected_statistics`: ``p = g / scale + e`` and, per segment, the float64 (sum, count) of
  the entries ``>= 0`` and of the others (the torch path sums in float32, torch's cascade; the
  kernel in float64, so the sums agree to float32-summation tolerance, the counts exactly);
* :func:`two_level_apply`: after the all-reduce of the statistics, the applied gradient (the
  segment's positive mean where ``p >= 0``, its negative mean elsewhere, times ``scale``) written
  into the gradient buffer, and the new error ``p - applied`` written over ``p``: bitwise the
  torch path's for the same statistics.

The kernel is compiled into the packing extension's library (``megatron._packing_cpp``, built by
setup.py) as torch operators ``torch.ops.megatron_a2sgd.*``. :func:`fused_ops` loads it once per
process; without it (no build, or a build that predates the kernel) and for CUDA or non-float32
buffers, :class:`~.a2sgd.A2SGDReducer` uses the torch path (``arithmetic="auto"``).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Optional

import torch

EXTENSION_MODULE = "megatron._packing_cpp"
ARITHMETICS = ("auto", "fused", "torch")  # A2SGDReducer(arithmetic=...)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[Any], str]:
    """(the ``torch.ops.megatron_a2sgd`` namespace or None, why not)."""
    try:
        importlib.import_module(EXTENSION_MODULE)  # loading the library registers the operators
    except ImportError as error:
        return None, (f"the C++ extension {EXTENSION_MODULE} is not built ({error}); build it with "
                      f"`pip install --no-build-isolation -e .`")
    try:
        ops = torch.ops.megatron_a2sgd
        ops.corrected_statistics, ops.two_level_apply  # noqa: B018  (present in this build?)
    except (AttributeError, RuntimeError):
        return None, (f"{EXTENSION_MODULE} was built without megatron/csrc/a2sgd.cpp (a stale "
                      f"build); rebuild it with `pip install --no-build-isolation -e .`")
    return ops, "loaded"


def fused_ops() -> Optional[Any]:
    """The kernel's operator namespace, or None when the extension does not provide it."""
    return _load()[0]


def unavailable_reason(buffer: torch.Tensor, error: torch.Tensor) -> Optional[str]:
    """Why the kernel cannot reduce ``buffer`` with the error ``error`` (None when it can)."""
    if fused_ops() is None:
        return _load()[1]
    for name, tensor in (("gradient buffer", buffer), ("error buffer", error)):
        if tensor.device.type != "cpu":
            return f"the {name} is on {tensor.device} (the kernel is CPU only)"
        if tensor.dtype != torch.float32:
            return f"the {name} is {tensor.dtype} (the kernel is float32 only)"
        if not tensor.is_contiguous():
            return f"the {name} is not contiguous"
    return None


def runs_table(runs) -> torch.Tensor:
    """int64 ``[runs, 3]`` of (start, segments, length) of a :class:`~.a2sgd.SegmentRuns`."""
    rows = [(start, segments, length) for start, segments, length, _ in runs.runs]
    return torch.tensor(rows, dtype=torch.int64).view(len(rows), 3)


def corrected_statistics(ops, gradient: torch.Tensor, error: torch.Tensor,
                         corrected: torch.Tensor, scale: float, table: torch.Tensor
                         ) -> torch.Tensor:
    """One pass: ``corrected = gradient / scale + error``; float64 ``[segments, 4]`` statistics
    (sum, count of the entries >= 0, sum, count of the others) per segment of ``table``."""
    return ops.corrected_statistics(gradient, error, corrected, float(scale), table)


def two_level_apply(ops, corrected: torch.Tensor, applied: torch.Tensor,
                    positive_means: torch.Tensor, negative_means: torch.Tensor, scale: float,
                    table: torch.Tensor) -> None:
    """One pass: ``applied = scale * (m+ where corrected >= 0 else m-)`` per segment, and
    ``corrected -= m+ / m-`` (the new error); the means are float32 ``[segments]``."""
    ops.two_level_apply(corrected, applied, positive_means, negative_means, float(scale), table)
