"""Hardware profiles as JSON files: what ``tools/performance_model.py --measure`` writes and
``--profile FILE`` reads. Pure Python (the measuring itself lives in
megatron/training/calibration.py, which needs torch).

A profile file is one JSON object: ``"hardware"`` holds the :class:`HardwareSpec` fields by
name (seconds, bytes, FLOP/s); ``"source"`` says where the numbers came from (free text) and
``"measurements"`` keeps the raw timings the constants were fitted on. Unknown fields in
``"hardware"`` are an error (a typo would otherwise fall back to a default silently);
missing ones take the dataclass defaults.
"""

from __future__ import annotations

import dataclasses
import json

from megatron.performance_model.specs import HardwareSpec

PROFILE_FORMAT = 1


def profile_dict(hardware: HardwareSpec, source: str = "", measurements=None) -> dict:
    """The JSON object of a profile."""
    return {"format": PROFILE_FORMAT, "source": source,
            "hardware": dataclasses.asdict(hardware), "measurements": measurements or {}}


def save_profile(path: str, hardware: HardwareSpec, source: str = "",
                 measurements=None) -> None:
    """Write ``hardware`` (and the measurements behind it) to ``path`` as JSON."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(profile_dict(hardware, source, measurements), handle, indent=2, sort_keys=True)
        handle.write("\n")


def hardware_from_dict(data: dict) -> HardwareSpec:
    """A HardwareSpec from a profile object (or its ``"hardware"`` part)."""
    fields = data.get("hardware", data)
    known = {field.name for field in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown hardware field(s) {', '.join(unknown)} in the profile; "
                         f"allowed: {', '.join(sorted(known))}")
    return HardwareSpec(**fields)


def load_profile(path: str) -> HardwareSpec:
    """Read a profile written by :func:`save_profile` (or by hand)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read hardware profile {path!r}: {error}") from error
    if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise ValueError(f"profile {path!r} has format {data.get('format')}; this version "
                         f"reads format {PROFILE_FORMAT}")
    return hardware_from_dict(data)
