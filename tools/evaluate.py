#!/usr/bin/env python
"""Evaluate a checkpoint (any layout): perplexity on a .bin/.idx data set, or zero-shot
LAMBADA-style last-word accuracy on a JSON-lines file.

    python tools/evaluate.py --load ckpt --task perplexity --data-path my-corpus_text_document
    python tools/evaluate.py --load ckpt --task lambada --input lambada_test.jsonl

Perplexity uses the training run's data flags (split, seed, sample counts) from the checkpoint, so
``--split-name valid`` evaluates the same samples as the training loop's validation and prints
exp(validation loss). Every launched process is one tensor-parallel rank. See docs/inference.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--task", choices=("perplexity", "lambada"), required=True)
    parser.add_argument("--data-path", nargs="+", default=None,
                        help="data set prefix(es) (default: the training run's)")
    parser.add_argument("--split-name", choices=("train", "valid", "test"), default="valid")
    parser.add_argument("--first-sample", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=None,
                        help="default: --eval-iters x --global-batch-size of the training run")
    parser.add_argument("--input", help="JSON-lines file with a \"text\" field (lambada)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--vocab-file", default=None)
    parser.add_argument("--merge-file", default=None)
    parser.add_argument("--tokenizer-model", default=None)
    return parser


def training_sample_counts(config) -> tuple:
    """The (train, valid, test) sample counts the training loop builds its data sets with (they
    decide the shuffling, so the same counts give the same samples)."""
    training = config.training
    batch = training.global_batch_size
    eval_runs = (training.train_iters // training.eval_interval + 1) if training.eval_interval \
        else 1
    return (training.train_iters * batch, eval_runs * training.eval_iters * batch,
            training.eval_iters * batch)


def run_perplexity(args, model, config, tokenizer, state, device) -> dict:
    import pretrain_gpt
    from megatron.inference.evaluation import dataset_loss, perplexity
    if args.data_path is not None:
        config.data.data_path = args.data_path
        config.data.mock_data = False
    datasets = pretrain_gpt.datasets_provider(config, state, training_sample_counts(config),
                                              tokenizer)
    dataset = datasets[("train", "valid", "test").index(args.split_name)]
    if dataset is None:
        raise ValueError(f"the {args.split_name} split is empty with the run's --split; choose "
                         f"another --split-name")
    count = args.num_samples or config.training.eval_iters * config.training.global_batch_size
    loss = dataset_loss(model, dataset, args.first_sample, count,
                        config.training.micro_batch_size, device)
    return {"samples": count, "loss": loss, "perplexity": perplexity(loss)}


def run_lambada(args, model, tokenizer, device) -> dict:
    from megatron.inference.evaluation import last_word_accuracy, read_last_word_examples
    if args.input is None:
        raise ValueError("--task lambada needs --input FILE.jsonl")
    if tokenizer is None:
        raise ValueError("--task lambada needs the run's tokenizer; the checkpoint has none")
    texts = read_last_word_examples(args.input)
    return {"examples": len(texts), "accuracy": last_word_accuracy(model, tokenizer, texts, device)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron.inference import launch
    try:
        device, state, model, config, tokenizer = launch.load_for_inference(args)
        result = (run_perplexity(args, model, config, tokenizer, state, device)
                  if args.task == "perplexity" else run_lambada(args, model, tokenizer, device))
    except ValueError as error:  # ConversionError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 1
    if state.rank == 0:
        print(" | ".join(f"{key} {value:.10g}" if isinstance(value, float) else f"{key} {value}"
                         for key, value in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
