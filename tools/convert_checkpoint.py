#!/usr/bin/env python
"""Convert a Megatron-Chimera checkpoint's weights to another parallel layout (TP, PP, schedule),
to a Hugging Face GPT-2, or from a Hugging Face GPT-2 or a Megatron-LM GPT checkpoint.

    python tools/convert_checkpoint.py --load ckpt_chimera --save ckpt_weights
    python tools/convert_checkpoint.py --load ckpt_chimera --save ckpt_pp2 --ckpt-format torch \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    python tools/convert_checkpoint.py --load ckpt --save hf_gpt2 --target-format hf
    python tools/convert_checkpoint.py --load hf_gpt2 --save ckpt_tp2 --source-format hf \\
        --tensor-model-parallel-size 2
    python tools/convert_checkpoint.py --load megatron_lm_ckpt --save ckpt \\
        --source-format megatron-lm

Reads either format (a torch source: every rank file of the iteration, the tracker's or
--iteration N, merged to full tensors in this one process; a torch_dist source holds whole tensors
already) and writes, like training, --ckpt-format torch_dist by default: whole tensors that load in
any layout (the layout flags then only validate the target); --ckpt-format torch writes the target
layout's per-rank files. The result holds weights only: load it with --finetune (start at
iteration 0) or --no-load-optim (keep the iteration and consumed samples). To resume a training
run in another layout with its optimizer state, no conversion is needed: load the checkpoint
(either format) directly in the new layout. See docs/checkpointing.md and docs/inference.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.pipeline_parallel.planning.schedules import BUILTIN_SCHEDULES  # noqa: E402
from megatron.training.checkpoint_conversion import (  # noqa: E402
    CKPT_FORMATS, DEFAULT_CKPT_FORMAT, ConversionError, TargetLayout, convert_checkpoint)


def build_parser() -> argparse.ArgumentParser:
    """The converter's flags (the target layout uses Megatron's flag names)."""
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="source checkpoint directory")
    parser.add_argument("--save", required=True, help="target directory (must not hold the "
                                                      "same iteration already)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to convert (default: the source's tracker)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="target layout (with --ckpt-format torch_dist the result loads in "
                        "any layout and the target flags are only validated)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-schedule", default=None,
                        choices=BUILTIN_SCHEDULES.names)
    parser.add_argument("--chimera-pipelines", type=int, default=2)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        help="uneven target stages: layers of the first pipeline stage")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                        help="uneven target stages: layers of the last pipeline stage")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    parser.add_argument("--source-format", choices=("native", "hf", "megatron-lm"),
                        default="native", help="--load holds: this project's checkpoint "
                        "(native), a Hugging Face GPT-2 directory (hf), or a Megatron-LM GPT "
                        "checkpoint, legacy or mcore layout, torch format (megatron-lm)")
    parser.add_argument("--target-format", choices=("native", "hf"), default="native",
                        help="write this project's checkpoint in the target layout (native) or "
                        "a Hugging Face GPT2LMHeadModel directory (hf; layout flags ignored)")
    parser.add_argument("--ckpt-format", choices=CKPT_FORMATS, default=DEFAULT_CKPT_FORMAT,
                        help="native target: global tensors that load in any layout (torch_dist, "
                        "the default, as for training) or the per-rank files of the target "
                        "layout (torch); either format is read")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="imports: training sequence length (default: the position table)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="hf imports: vocabulary padding multiple (x TP size)")
    return parser


def main(argv=None) -> int:
    """Run the conversion; exit status 1 with the error on one line when it cannot be done."""
    args = build_parser().parse_args(argv)
    target = TargetLayout(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_schedule=args.pipeline_schedule,
        chimera_pipelines=args.chimera_pipelines,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_pipeline_rank=args.num_virtual_stages_per_pipeline_rank,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split)
    try:
        if args.source_format != "native" and args.target_format != "native":
            raise ConversionError("convert to or from this project's format: --source-format "
                                  "and --target-format cannot both be foreign")
        if args.target_format == "hf":
            from megatron.training.hf_checkpoint import export_to_hf
            export_to_hf(args.load, args.save, iteration=args.iteration)
        elif args.source_format == "hf":
            from megatron.training.hf_checkpoint import import_from_hf
            import_from_hf(args.load, args.save, target, seq_length=args.seq_length,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                           ckpt_format=args.ckpt_format)
        elif args.source_format == "megatron-lm":
            from megatron.training.megatron_lm_import import import_megatron_lm
            import_megatron_lm(args.load, args.save, target, iteration=args.iteration,
                               seq_length=args.seq_length, ckpt_format=args.ckpt_format)
        else:
            convert_checkpoint(args.load, args.save, target, iteration=args.iteration,
                               ckpt_format=args.ckpt_format)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
