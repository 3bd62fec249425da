#!/usr/bin/env python
"""Generate text from a checkpoint (any layout) with a KV cache: greedy, or sampling with
temperature, top-k and top-p.

    python tools/generate.py --load ckpt --prompt "The meaning of life is" --max-new-tokens 32
    torchrun --nproc-per-node 2 tools/generate.py --load ckpt --prompt "..." --top-k 40

Every launched process is one tensor-parallel rank (pipeline stages are gathered into each
process); all ranks produce the same tokens and rank 0 prints them. See docs/inference.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory (any layout)")
    parser.add_argument("--iteration", type=int, default=None)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    prompt.add_argument("--prompt-ids", help="prompt as space-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true", help="most likely token (default "
                        "unless --temperature/--top-k/--top-p is given)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--vocab-file", default=None, help="moved GPT-2 vocab.json")
    parser.add_argument("--merge-file", default=None, help="moved GPT-2 merges.txt")
    parser.add_argument("--tokenizer-model", default=None, help="moved SentencePiece model")
    return parser


def sampling_from_args(args):
    from megatron.inference.generation import SamplingParams
    sampled = args.temperature is not None or args.top_k or args.top_p < 1.0
    return SamplingParams(greedy=args.greedy or not sampled,
                          temperature=1.0 if args.temperature is None else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron.inference import launch
    from megatron.inference.generation import generate
    from megatron.training.checkpoint_conversion import ConversionError
    try:
        params = sampling_from_args(args)
        device, state, model, config, tokenizer = launch.load_for_inference(args)
        if args.prompt and tokenizer is None:
            raise ValueError("the checkpoint has no tokenizer (mock data); use --prompt-ids")
        prompts = ([tokenizer.tokenize(text) for text in args.prompt] if args.prompt
                   else [[int(token) for token in args.prompt_ids.split()]])
        vocab = tokenizer.vocab_size if tokenizer is not None else None
        eod = getattr(tokenizer, "eod", None)
        for prompt in prompts:
            ids = generate(model, prompt, args.max_new_tokens, params, vocab, stop_token=eod)
            if state.rank == 0:
                print(tokenizer.detokenize(prompt + ids) if tokenizer is not None
                      else " ".join(map(str, prompt + ids)), flush=True)
    except (ValueError, ConversionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
