"""Text rendering of rank x step grids, used by error messages and the schedule viewer.

Two shapes: an *op grid* (one column per position in each rank's list, used by the validator
and the deadlock report, with offending cells marked) and a *time grid* (one column per time
unit of a simulated timeline, used by tools/show_schedule.py). No torch import.
"""

from __future__ import annotations

from fractions import Fraction

MARK_LEFT, MARK_RIGHT = ">", "<"


def format_op_grid(rows, marks=(), max_columns: int = 40, title: str = "") -> str:
    """Render ``rows[rank][step]`` (strings) as an aligned grid; cells in ``marks`` (a set of
    (rank, step)) are drawn as ``>cell<``. Wide grids show only a window around the marks."""
    marks = set(marks)
    num_columns = max((len(row) for row in rows), default=0)
    first, last = 0, num_columns
    if num_columns > max_columns:
        centre = min((step for _, step in marks), default=0)
        first = max(0, min(centre - max_columns // 4, num_columns - max_columns))
        last = first + max_columns

    def cell(rank, step):
        if step >= len(rows[rank]):
            return ""
        text = rows[rank][step]
        return f"{MARK_LEFT}{text}{MARK_RIGHT}" if (rank, step) in marks else f" {text} "

    widths = [max([len(cell(rank, step)) for rank in range(len(rows))] + [len(str(step))])
              for step in range(first, last)]
    label_width = len(f"rank {len(rows) - 1}")
    lines = [title] if title else []
    header = " " * (label_width + 1) + "".join(
        str(step).center(width) for step, width in zip(range(first, last), widths))
    lines.append(header.rstrip())
    for rank in range(len(rows)):
        body = "".join(cell(rank, step).ljust(width)
                       for step, width in zip(range(first, last), widths))
        prefix = "... " if first > 0 else ""
        suffix = " ..." if last < num_columns and len(rows[rank]) > last else ""
        lines.append(f"{f'rank {rank}'.ljust(label_width)} {prefix}{body.rstrip()}{suffix}")
    if first > 0 or last < num_columns:
        lines.append(f"(steps {first}..{last - 1} of {num_columns} shown)")
    return "\n".join(lines)


def time_unit(durations) -> Fraction:
    """Largest time unit that divides every duration (all positive rationals)."""
    unit = None
    for duration in durations:
        value = Fraction(duration).limit_denominator(1000)
        if value <= 0:
            continue
        if unit is None:
            unit = value
        else:  # gcd of two rationals
            num = _gcd(unit.numerator * value.denominator, value.numerator * unit.denominator)
            unit = Fraction(num, unit.denominator * value.denominator)
    return unit or Fraction(1)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def format_time_grid(timelines, unit, label=str, makespan=None) -> str:
    """Render per-rank timelines ``[(label_source, start, end), ...]`` with one column per
    ``unit`` of time; idle columns are '.'. Every column an op covers shows its label."""
    unit = Fraction(unit).limit_denominator(1000)
    end_time = makespan if makespan is not None else max(
        (end for timeline in timelines for _, _, end in timeline), default=0)
    num_columns = int(round(Fraction(end_time).limit_denominator(1000) / unit))
    grid = [["."] * num_columns for _ in timelines]
    for rank, timeline in enumerate(timelines):
        for op, start, end in timeline:
            first = int(round(Fraction(start).limit_denominator(1000) / unit))
            last = int(round(Fraction(end).limit_denominator(1000) / unit))
            for column in range(first, last):
                grid[rank][column] = label(op)
    width = max([len(text) for row in grid for text in row] + [1])
    label_width = len(f"P{len(timelines) - 1}")
    return "\n".join(f"{f'P{rank}'.ljust(label_width)}: "
                     + " ".join(text.ljust(width) for text in row).rstrip()
                     for rank, row in enumerate(grid))
