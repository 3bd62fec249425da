"""The compute instruction of a pipeline schedule and its compact text form.

A schedule is a list with one entry per pipeline rank; each entry is the ordered list of
:class:`Instruction` records that rank executes. This module owns the record and the text
form used in logs, golden files and CSV files. It imports nothing from torch.

Text form: ``<kind><pipeline>.<stage>.<microbatch>`` with an optional ``.<chunk>`` suffix when
the chunk is not 0, e.g. ``F0.2.5`` (forward of pipeline 0, stage 2, micro-batch 5) or
``B1.0.3.1`` (backward of pipeline 1, stage 0, micro-batch 3, run by the rank's model chunk 1).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What a compute instruction does. The value is the one-letter code of the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    # Split backward (zero-bubble style): input gradient first, weight gradient later.
    # No builder emits them yet; the record, text form and validator already accept them.
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"

    @property
    def is_forward(self) -> bool:
        return self is Kind.FORWARD

    @property
    def is_backward(self) -> bool:
        return self is not Kind.FORWARD


_TEXT_PATTERN = re.compile(r"^([FBIW])(\d+)\.(\d+)\.(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Instruction:
    """One compute step of one pipeline rank.

    Attributes:
        kind: forward or backward (see :class:`Kind`).
        pipeline: pipeline id. 0 for the one-directional schedules; for Chimera the down
            pipelines have even ids and the up pipelines odd ids (down 0, up 1 with f = 1).
        stage: stage index inside the pipeline, 0 .. num_stages - 1 (for interleaved 1F1B the
            virtual stage, chunk * pipeline_size + rank).
        microbatch: index of the micro-batch within the iteration on this data-parallel rank
            (see ``ScheduleLayout.microbatch_samples`` for the samples it covers).
        chunk: index of the model chunk on the executing rank that runs this stage, i.e. the
            position of (pipeline, stage) in ``ScheduleLayout.hosted(rank)``.
    """

    kind: Kind
    pipeline: int
    stage: int
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if type(self.kind) is not Kind:
            object.__setattr__(self, "kind", Kind(self.kind))
        if min(self.pipeline, self.stage, self.microbatch, self.chunk) < 0:
            raise ValueError(f"Instruction fields must be non-negative: {self!r}")

    @property
    def module(self) -> tuple[int, int]:
        """The (pipeline, stage) whose weights this instruction uses."""
        return (self.pipeline, self.stage)

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.pipeline}.{self.stage}.{self.microbatch}"
        return text if self.chunk == 0 else f"{text}.{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> "Instruction":
        """Inverse of ``str(instruction)``."""
        match = _TEXT_PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse instruction {text!r}; expected <kind><pipeline>.<stage>.<microbatch>"
                f"[.<chunk>] with kind one of F, B, I, W, e.g. 'F0.2.5'")
        kind, pipeline, stage, microbatch, chunk = match.groups()
        return cls(Kind(kind), int(pipeline), int(stage), int(microbatch),
                   int(chunk) if chunk is not None else 0)


def forward(pipeline: int, stage: int, microbatch: int, chunk: int = 0) -> Instruction:
    """Shorthand for a forward instruction."""
    return Instruction(Kind.FORWARD, pipeline, stage, microbatch, chunk)


def backward(pipeline: int, stage: int, microbatch: int, chunk: int = 0) -> Instruction:
    """Shorthand for a (full) backward instruction."""
    return Instruction(Kind.BACKWARD, pipeline, stage, microbatch, chunk)


# Text of a rank that has no instruction (keeps one line per rank in the text form).
EMPTY_RANK = "-"


def format_schedule(schedule) -> str:
    """Text form of a whole schedule: one line per rank, instructions separated by spaces."""
    return "\n".join(" ".join(str(op) for op in ops) or EMPTY_RANK for ops in schedule) + "\n"


def parse_schedule(text: str) -> list[list[Instruction]]:
    """Inverse of :func:`format_schedule`. Blank lines and lines starting with '#' are skipped."""
    schedule = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line == EMPTY_RANK:
            schedule.append([])
            continue
        schedule.append([Instruction.parse(token) for token in line.split()])
    return schedule


def format_schedule_csv(schedule) -> str:
    """CSV form of a schedule: one row per rank, ``rank,<op>,<op>,...`` (text form per cell)."""
    return "".join(",".join([str(rank)] + [str(op) for op in ops]) + "\n"
                   for rank, ops in enumerate(schedule))


def parse_schedule_csv(text: str) -> list[list[Instruction]]:
    """Inverse of :func:`format_schedule_csv`; rows must list ranks 0, 1, 2, ... in order."""
    schedule = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if cells[0] != str(len(schedule)):
            raise ValueError(f"CSV row for rank {cells[0]!r} found where rank {len(schedule)} "
                             f"was expected; rows must be ranks 0, 1, 2, ... in order")
        schedule.append([Instruction.parse(cell) for cell in cells[1:] if cell])
    return schedule
