#!/usr/bin/env python
"""Convert a Megatron-Chimera checkpoint's weights to another parallel layout (TP, PP, schedule).

    python tools/convert_checkpoint.py --load ckpt_chimera --save ckpt_single \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1

Reads every rank file of the iteration (the tracker's, or --iteration N) in this one process,
merges each parameter to its full tensor and writes the target layout's files. The result holds
weights only: load it with --finetune (start at iteration 0) or --no-load-optim (keep the
iteration and consumed samples). See docs/checkpointing.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES  # noqa: E402
from megatron.training.checkpoint_conversion import (  # noqa: E402
    ConversionError, TargetLayout, convert_checkpoint)


def build_parser() -> argparse.ArgumentParser:
    """The converter's flags (the target layout uses Megatron's flag names)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="source checkpoint directory")
    parser.add_argument("--save", required=True, help="target directory (must not hold the "
                                                      "same iteration already)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to convert (default: the source's tracker)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-schedule", default=None,
                        choices=BUILTIN_SCHEDULES.names)
    parser.add_argument("--chimera-pipelines", type=int, default=2)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    return parser


def main(argv=None) -> int:
    """Run the conversion; exit status 1 with the error on one line when it cannot be done."""
    args = build_parser().parse_args(argv)
    target = TargetLayout(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_schedule=args.pipeline_schedule,
        chimera_pipelines=args.chimera_pipelines,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage)
    try:
        convert_checkpoint(args.load, args.save, target, iteration=args.iteration)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
