"""Per-stage op costs from a file: what ``--pipeline-op-costs FILE`` hands the planner.

Two forms are read (JSON), both in seconds:

* ``{"stages": [[F, I, W], ...]}``: one entry per stage of the schedule's pipeline, or one per
  pipeline rank (D entries) when the schedule cuts the model into v·D virtual stages (interleaved
  1F1B): virtual stage s then holds 1/v of the model segment ``s // v`` and is charged 1/v of its
  entry. A first stage's I is still charged to its W half (:mod:`.op_costs`).
* ``tools/performance_model.py --measure`` output: its ``measurements.compute`` records
  (``layers``, ``micro_batch_size``, ``forward_s``, ``backward_s``). The record of the configured
  micro-batch size with the most layers gives the per-layer forward and backward; every stage is
  charged its layer count times those, the backward split ``input_share`` : 1 - ``input_share``.

Either form may also give what a run spends besides compute (seconds; default 0, the free-message
plan): ``"op_overhead": [oF, oI, oW]`` per op and ``"message_latency": δ`` per message between ranks
(e.g. as ``benchmarks/emulated_depth.py`` calibrates them). With δ > 0 a split-backward plan is
placed latency-tolerant (:mod:`.schedules.split_backward`).

Only the ratios matter to the planner (where split backward defers weight work, how the lowering
groups messages), so the seconds need not match the run. No torch import.
"""

from __future__ import annotations

import json
from typing import Optional

from .op_costs import StageCosts


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--pipeline-op-costs: cannot read {path!r}: {error}; give a JSON file "
                         f"with 'stages' [[F, I, W], ...] or tools/performance_model.py --measure "
                         f"output") from error
    if not isinstance(data, dict):
        raise ValueError(f"--pipeline-op-costs: {path!r} must hold a JSON object")
    return data


def _from_stage_list(path: str, entries, num_stages: int, pipeline_size: int) -> dict:
    if not isinstance(entries, list) or any(
            not isinstance(entry, (list, tuple)) or len(entry) != 3 for entry in entries):
        raise ValueError(f"--pipeline-op-costs: {path!r}: 'stages' must be a list of [F, I, W] "
                         f"(seconds)")
    values = [tuple(float(v) for v in entry) for entry in entries]
    if len(values) == num_stages:
        return dict(enumerate(values))
    if len(values) == pipeline_size and num_stages % pipeline_size == 0:
        chunks = num_stages // pipeline_size
        return {stage: tuple(v / chunks for v in values[stage // chunks])
                for stage in range(num_stages)}
    raise ValueError(f"--pipeline-op-costs: {path!r} gives {len(values)} stage entries; the "
                     f"schedule has {num_stages} stages per pipeline on {pipeline_size} ranks: "
                     f"give {num_stages} (or {pipeline_size}) entries [F, I, W]")


def _from_measurements(path: str, data: dict, stage_layers, micro_batch_size: int,
                       input_share: float) -> dict:
    records = (data.get("measurements") or {}).get("compute") or []
    if not records:
        raise ValueError(f"--pipeline-op-costs: {path!r} has neither 'stages' nor "
                         f"measurements.compute records; write it with "
                         f"tools/performance_model.py --measure")
    matching = [r for r in records if r.get("micro_batch_size") == micro_batch_size]
    if not matching:
        sizes = sorted({r.get("micro_batch_size") for r in records})
        raise ValueError(f"--pipeline-op-costs: {path!r} has no record for micro-batch size "
                         f"{micro_batch_size} (measured: {sizes}); rerun --measure with "
                         f"--measure-micro-batch-sizes including {micro_batch_size}")
    record = max(matching, key=lambda r: r["layers"])
    forward = float(record["forward_s"]) / record["layers"]
    backward = float(record["backward_s"]) / record["layers"]
    return {stage: (forward * layers, backward * layers * input_share,
                    backward * layers * (1 - input_share))
            for stage, layers in enumerate(stage_layers)}


def load_stage_costs(path: str, num_stages: int, pipeline_size: int, *,
                     stage_layers: Optional[list] = None, micro_batch_size: int = 1,
                     input_share: float = 0.5) -> StageCosts:
    """The planner's :class:`StageCosts` for a schedule of ``num_stages`` stages per pipeline on
    ``pipeline_size`` ranks, from ``path`` (see the module docstring). ``stage_layers``: layers of
    each stage (default: equal), used by the ``--measure`` form."""
    if not 0.0 <= input_share <= 1.0:
        raise ValueError(f"input_share is I / B and must lie in [0, 1], got {input_share}")
    data = _read(path)
    if "stages" in data:
        per_stage = _from_stage_list(path, data["stages"], num_stages, pipeline_size)
    else:
        layers = list(stage_layers) if stage_layers is not None else [1] * num_stages
        if len(layers) != num_stages:
            raise ValueError(f"stage_layers gives {len(layers)} stages, the schedule has "
                             f"{num_stages}")
        per_stage = _from_measurements(path, data, layers, micro_batch_size, input_share)
    return StageCosts(num_stages, per_stage=per_stage).with_overheads(*_overheads(path, data))


def _overheads(path: str, data: dict) -> tuple:
    """(op_overhead, message_latency) of the file (zeros when absent)."""
    overhead = data.get("op_overhead", [0.0, 0.0, 0.0])
    latency = data.get("message_latency", 0.0)
    try:
        overhead = tuple(float(value) for value in overhead)
        latency = float(latency)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--pipeline-op-costs: {path!r}: 'op_overhead' must be [oF, oI, oW] and "
                         f"'message_latency' a number (seconds)") from error
    if len(overhead) != 3 or min(overhead) < 0 or latency < 0:
        raise ValueError(f"--pipeline-op-costs: {path!r}: 'op_overhead' must be three numbers "
                         f">= 0 [oF, oI, oW] and 'message_latency' >= 0 (seconds); got "
                         f"{list(overhead)} and {latency}")
    return overhead, latency


def message_latency(path: str) -> float:
    """The file's ``message_latency`` δ in seconds (0 when absent); ValueError naming the problem
    for an unreadable file or a bad value."""
    return _overheads(path, _read(path))[1]
