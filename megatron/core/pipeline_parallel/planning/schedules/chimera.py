"""Chimera bidirectional pipelines (Li & Hoefler, SC'21), following shared/reference/chimera.md.

Pipelines: with 2f pipelines (option ``num_pipelines``, default 2, f dividing D/2) pipeline
``2i`` is down pipeline i and ``2i + 1`` is up pipeline i. Down pipeline i places stage s on
rank ``(s + i D/f) mod D``; up pipeline i is its exact reverse, stage s on rank
``(D - 1 - s + i D/f) mod D``. With f = 1: down (0) stage s on rank s, up (1) on rank D-1-s.

Units and micro-batch numbering (instruction micro-batch indices; for backward halving these
are half micro-batches, see ``ScheduleLayout.microbatch_samples``):

* A *basic unit* holds R <= D consecutive micro-batches. They are cut into 2f consecutive
  blocks, block k going to pipeline k, of sizes ``R // 2f + (1 if k < R % 2f else 0)``. For a full
  unit (R = D) that is: micro-batch m goes to pipeline ``(m mod D) // (D / 2f)``; with f = 1,
  down when ``m mod D < D/2``, else up.
* A *doubling unit* holds 2D consecutive micro-batches = two full basic blocks numbered as
  above; each pipeline's forwards run in pairs of consecutive micro-batches of that pipeline.
  For D = 4, f = 1: down = 0, 1, 4, 5 (pairs (0,1), (4,5)), up = 2, 3, 6, 7.

Variants (N = micro-batches of size B per rank per iteration):

* ``direct``: ceil(N / D) basic units, the last one partial when D does not divide N (N < D is
  one partial unit: missing micro-batches' ops dropped from the basic unit).
* ``forward-doubling`` (N = K D, 2 pipelines only): K // 2 doubling units, then one basic unit if K is odd.
* ``backward-halving`` (N = K D, 2 pipelines only): the forward-doubling order over 2N half micro-batches,
  i.e. K doubling units of 2D half micro-batches.

Slot rule (F = Bk = one slot): for stage s and the pipeline's j-th micro-batch of a unit
starting at slot ``t0``: basic unit forward at ``t0 + s + 2j`` and backward at
``t0 + 2D - 1 - s + 2j``; doubling unit forward pair ``j // 2`` at ``t0 + s + 2 (j // 2)`` and
backward at ``t0 + 2D - 1 - s + 2j``. Units start every 2D slots (basic) or 3D slots (doubling).
A rank's order is its ops sorted by slot; the builder checks that no two ops share a slot.
"""

from __future__ import annotations

from fractions import Fraction

from ..instructions import Instruction, backward, forward
from .chimera_interleaved import build_interleaved_chimera, interleaved_chimera_placements
from .family import ScheduleFamily, ScheduleOption, even_stage_config
from .layout import ScheduleLayout

VARIANTS = ("direct", "forward-doubling", "backward-halving", "interleaved")

# Slots a basic / doubling unit advances the start of the next unit by (chimera.md §3).
_BASIC_UNIT_SLOTS = 2
_DOUBLING_UNIT_SLOTS = 3


def check_chimera(pipeline_size: int, num_microbatches: int, num_pipelines=2,
                  variant="direct") -> None:
    """Raise ValueError unless the Chimera options are valid (see the module docstring)."""
    depth = pipeline_size
    if depth < 2 or depth % 2 != 0:
        raise ValueError(
            f"Chimera needs an even pipeline depth (an even --pipeline-model-parallel-size >= 2, "
            f"got {depth}); allowed: 2, 4, 6, 8, ...; use an even size or another "
            f"--pipeline-schedule")
    if not isinstance(num_pipelines, int) or num_pipelines < 2 or num_pipelines % 2 != 0:
        raise ValueError(
            f"--chimera-pipelines {num_pipelines!r} must be an even number 2f >= 2 (f down and f "
            f"up pipelines, f dividing D/2 = {depth // 2}); allowed: "
            f"{_allowed_num_pipelines(depth)}")
    f = num_pipelines // 2
    if (depth // 2) % f != 0:
        raise ValueError(
            f"chimera with {num_pipelines} pipelines needs f = {f} to divide D/2 = {depth // 2}; "
            f"allowed --chimera-pipelines for D = {depth}: {_allowed_num_pipelines(depth)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown chimera variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"chimera needs at least one micro-batch (got {num_microbatches!r})")
    if variant != "direct" and num_pipelines != 2:
        raise ValueError(
            f"chimera variant {variant} is defined for 2 pipelines only (got {num_pipelines}); "
            f"use --chimera-pipelines 2 or --chimera-variant direct")
    if variant in ("forward-doubling", "backward-halving") and num_microbatches % depth != 0:
        raise ValueError(
            f"chimera variant {variant} needs the number of micro-batches ({num_microbatches}) "
            f"to be a multiple of D = {depth} (allowed: {depth}, {2 * depth}, {3 * depth}, ...); "
            f"use --chimera-variant direct for other counts")


def _allowed_num_pipelines(depth: int) -> str:
    half = depth // 2
    return ", ".join(str(2 * f) for f in range(1, half + 1) if half % f == 0)


def chimera_placements(pipeline_size: int, num_pipelines: int = 2) -> tuple[tuple[int, ...], ...]:
    """``placements[pipeline][stage]`` -> rank, for 2f = num_pipelines pipelines of D stages."""
    depth = pipeline_size
    shift = depth // (num_pipelines // 2)
    placements = []
    for pair in range(num_pipelines // 2):
        placements.append(tuple((stage + pair * shift) % depth for stage in range(depth)))
        placements.append(tuple((depth - 1 - stage + pair * shift) % depth
                                for stage in range(depth)))
    return tuple(placements)


def _split_basic_block(first: int, count: int, num_pipelines: int) -> list[list[int]]:
    """Micro-batches first .. first+count-1 cut into consecutive per-pipeline blocks."""
    blocks, start = [], first
    for pipeline in range(num_pipelines):
        size = count // num_pipelines + (1 if pipeline < count % num_pipelines else 0)
        blocks.append(list(range(start, start + size)))
        start += size
    return blocks


def chimera_units(pipeline_size: int, num_microbatches: int, num_pipelines: int = 2,
                  variant: str = "direct") -> list[tuple[str, list[list[int]]]]:
    """The units of the iteration in order: ``(kind, microbatches_per_pipeline)`` with kind
    "basic" or "doubling" and instruction micro-batch indices per pipeline, in execution order."""
    check_chimera(pipeline_size, num_microbatches, num_pipelines, variant)
    depth = pipeline_size
    units = []
    if variant == "direct":
        for first in range(0, num_microbatches, depth):
            count = min(depth, num_microbatches - first)
            units.append(("basic", _split_basic_block(first, count, num_pipelines)))
        return units
    num_instruction_microbatches = num_microbatches * (2 if variant == "backward-halving" else 1)
    num_basic_blocks = num_instruction_microbatches // depth
    first = 0
    for _ in range(num_basic_blocks // 2):
        low = _split_basic_block(first, depth, num_pipelines)
        high = _split_basic_block(first + depth, depth, num_pipelines)
        units.append(("doubling", [a + b for a, b in zip(low, high)]))
        first += 2 * depth
    if num_basic_blocks % 2:
        units.append(("basic", _split_basic_block(first, depth, num_pipelines)))
    return units


def build_chimera(pipeline_size: int, num_microbatches: int, num_pipelines: int = 2,
                  variant: str = "direct") -> list[list[Instruction]]:
    """Per-rank instruction lists of Chimera (see the module docstring for the numbering)."""
    depth = pipeline_size
    if variant == "interleaved":
        units = chimera_units(depth, num_microbatches, num_pipelines, "direct")
        per_pipeline = [[m for _, blocks in units for m in blocks[p]] for p in range(2)]
        return build_interleaved_chimera(depth, per_pipeline)
    placements = chimera_placements(depth, num_pipelines)
    # Chunk of (pipeline, stage) on its rank: position in the rank's modules ordered by pipeline.
    chunk_of = {}
    for rank in range(depth):
        hosted = [(p, s) for p in range(num_pipelines) for s in range(depth)
                  if placements[p][s] == rank]
        chunk_of.update({module: index for index, module in enumerate(hosted)})

    timed = [[] for _ in range(depth)]  # per rank: (slot, position inside slot, instruction)
    unit_start = 0
    for kind, pipeline_microbatches in chimera_units(depth, num_microbatches, num_pipelines,
                                                     variant):
        for pipeline, microbatches in enumerate(pipeline_microbatches):
            for stage in range(depth):
                rank, chunk = placements[pipeline][stage], chunk_of[(pipeline, stage)]
                for j, microbatch in enumerate(microbatches):
                    if kind == "basic":
                        forward_slot, position = stage + 2 * j, 0
                    else:
                        forward_slot, position = stage + 2 * (j // 2), j % 2
                    backward_slot = 2 * depth - 1 - stage + 2 * j
                    timed[rank].append((unit_start + forward_slot, position,
                                        forward(pipeline, stage, microbatch, chunk)))
                    timed[rank].append((unit_start + backward_slot, 0,
                                        backward(pipeline, stage, microbatch, chunk)))
        unit_start += depth * (_BASIC_UNIT_SLOTS if kind == "basic" else _DOUBLING_UNIT_SLOTS)

    schedule = []
    for rank, ops in enumerate(timed):
        ops.sort(key=lambda item: (item[0], item[1]))
        _check_no_slot_conflict(rank, ops)
        schedule.append([op for _, _, op in ops])
    return schedule


def _check_no_slot_conflict(rank: int, ops) -> None:
    """Internal invariant: a slot holds one op, or one forward pair of one (pipeline, stage)."""
    by_slot = {}
    for slot, _, op in ops:
        by_slot.setdefault(slot, []).append(op)
    for slot, slot_ops in by_slot.items():
        pair = (len(slot_ops) == 2 and all(op.kind.is_forward for op in slot_ops)
                and slot_ops[0].module == slot_ops[1].module)
        assert len(slot_ops) == 1 or pair, (
            f"chimera slot conflict on rank {rank} at slot {slot}: "
            f"{' '.join(map(str, slot_ops))}")


def chimera_layout(pipeline_size: int, num_pipelines: int = 2,
                   variant: str = "direct") -> ScheduleLayout:
    """2f pipelines of D stages (see :func:`chimera_placements`); backward halving runs half
    micro-batches; the doubling variants pair forwards inside units of 2D micro-batches."""
    if variant == "interleaved":
        return ScheduleLayout("chimera interleaved", pipeline_size, 2 * pipeline_size,
                              interleaved_chimera_placements(pipeline_size))
    fraction = Fraction(1, 2) if variant == "backward-halving" else Fraction(1)
    doubling_unit = 2 * pipeline_size if variant in ("forward-doubling", "backward-halving") else 0
    return ScheduleLayout(f"chimera {variant}", pipeline_size, pipeline_size,
                          chimera_placements(pipeline_size, num_pipelines), fraction,
                          doubling_unit)


def chimera_config(parallel_config, num_layers: int) -> dict:
    """Config rule: equal stages of num_layers / D layers; the interleaved variant cuts each
    direction into 2D stages, so --num-layers must be a multiple of 2D."""
    even_stage_config(parallel_config, num_layers)
    stages = 2 * parallel_config.pipeline_model_parallel_size
    if getattr(parallel_config, "chimera_variant", "direct") == "interleaved" and num_layers % stages:
        raise ValueError(f"--chimera-variant interleaved cuts each direction into 2D = {stages} "
                         f"stages; --num-layers {num_layers} is not a multiple of {stages} (use a "
                         f"multiple of {stages} layers or another --chimera-variant)")
    return {}


def chimera_critical_path(pipeline_size: int, num_microbatches: int, num_pipelines: int = 2,
                          variant: str = "direct"):
    """(Cf, Cb) forwards and backwards on the critical path, or None where no closed form is known.

    Direct (2 pipelines), N = K D: Cf = 2K + D - 2, Cb = K (2D - 2), the exact
    zero-communication makespan for Bk >= F (chimera.md §4); forward doubling with N = D is the
    same basic unit. 2f pipelines, N = D: Cf = D, Cb = D + D/f - 2. Otherwise None.
    """
    d, n = pipeline_size, num_microbatches
    if num_pipelines > 2:
        f = num_pipelines // 2
        return (d, d + d // f - 2) if n == d else None
    if variant == "interleaved":
        return None
    basic = variant == "direct" or n == d
    if not basic or n % d:
        return None
    k = n // d
    return 2 * k + d - 2, k * (2 * d - 2)


def chimera_op_label(op: Instruction, options: dict) -> str:
    """'v' for a down pipeline, '^' for an up one, then the pair index when 2f > 2."""
    label = "v" if op.pipeline % 2 == 0 else "^"
    if options.get("num_pipelines", 2) > 2:
        label += str(op.pipeline // 2)
    return label


CHIMERA = ScheduleFamily(
    name="chimera", description="bidirectional pipelines (Li & Hoefler, SC'21)",
    build=build_chimera, layout=chimera_layout, check=check_chimera, op_label=chimera_op_label,
    options=(
        ScheduleOption("num_pipelines", 2, "chimera_pipelines", "--chimera-pipelines", int,
                       help="Number of Chimera pipelines 2f (f down, f up); f must divide D/2."),
        ScheduleOption("variant", "direct", "chimera_variant", "--chimera-variant", str,
                       choices=VARIANTS, help="How Chimera schedules N > D micro-batches."),
    ),
    checkpoint_options=("num_pipelines",),
    critical_path=chimera_critical_path,
    derive_config=chimera_config,
    model_variants=(("-direct", {"variant": "direct"}),
                    ("-forward-doubling", {"variant": "forward-doubling"}),
                    ("-backward-halving", {"variant": "backward-halving"}),
                    ("-direct-4p", {"variant": "direct", "num_pipelines": 4}),
                    ("-direct-8p", {"variant": "direct", "num_pipelines": 8})),
    memory_note=lambda options: (
        "--chimera-variant forward-doubling doubles the stored activations; it is meant to be "
        "combined with --recompute-granularity full" if options.get("variant") == "forward-doubling"
        else None))
