"""The project's schedule families, in the order ``--help`` lists them. No torch import."""

from __future__ import annotations

from .chimera import CHIMERA
from .family import ScheduleRegistry
from .gpipe import GPIPE
from .interleaved import INTERLEAVED_1F1B
from .one_f_one_b import ONE_F_ONE_B

BUILTIN_SCHEDULES = ScheduleRegistry((GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, CHIMERA),
                                     default="1f1b")
