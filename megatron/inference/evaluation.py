"""Evaluation of a loaded model: perplexity on a dataset and LAMBADA-style last-word accuracy.

:func:`dataset_loss` averages the per-token loss over samples exactly as the training loop's
validation does (``pretrain_gpt.loss_func``: loss-mask-weighted mean per micro-batch, then the
mean over micro-batches), so ``exp`` of it equals ``exp(validation loss)`` for the same samples.
:func:`last_word_accuracy` reads JSON lines ``{"text": "... last"}``, feeds all tokens but the
last word's and counts a hit when greedy decoding reproduces every token of the last word.
"""

from __future__ import annotations

import json
import math

import torch

from megatron.training.microbatches import batch_from_samples


@torch.no_grad()
def dataset_loss(model, dataset, first_sample: int, num_samples: int, micro_batch_size: int,
                 device=None) -> float:
    """Mean loss of ``dataset`` samples ``[first_sample, first_sample + num_samples)``."""
    if num_samples <= 0 or num_samples % micro_batch_size:
        raise ValueError(f"the number of samples {num_samples} must be a positive multiple of "
                         f"the micro-batch size {micro_batch_size}")
    total, count = 0.0, 0
    for start in range(first_sample, first_sample + num_samples, micro_batch_size):
        ids = range(start, start + micro_batch_size)
        batch = batch_from_samples([dataset[index] for index in ids], ids, device or "cpu")
        losses = model(batch["tokens"], batch["labels"]).float()
        mask = batch["loss_mask"]
        mask = mask.reshape(-1).float()
        total += (torch.sum(losses.reshape(-1) * mask) / mask.sum()).item()
        count += 1
    return total / count


def perplexity(loss: float) -> float:
    """``exp(loss)``, the perplexity of a mean per-token cross-entropy."""
    return math.exp(loss)


def read_last_word_examples(path: str) -> list[str]:
    """The ``text`` field of every line of a JSON-lines file (LAMBADA's format)."""
    texts = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON ({error}); expected "
                                 f'{{"text": "..."}} per line') from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{path} line {number} has no "text" string field')
            texts.append(record["text"])
    if not texts:
        raise ValueError(f"{path} holds no examples")
    return texts


def split_last_word(text: str, tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, last-word ids): the last word keeps its leading space, as GPT-2 encodes it."""
    stripped = text.rstrip()
    cut = stripped.rfind(" ")
    if cut <= 0:
        raise ValueError(f"example {text[:40]!r} has no context before its last word")
    return tokenizer.tokenize(stripped[:cut]), tokenizer.tokenize(stripped[cut:])


@torch.no_grad()
def last_word_accuracy(model, tokenizer, texts: list[str], device=None) -> float:
    """Fraction of ``texts`` whose last word greedy decoding predicts token for token."""
    from megatron.inference.generation import full_logits

    hits = 0
    vocab = tokenizer.vocab_size
    for text in texts:
        context, target = split_last_word(text, tokenizer)
        ids = torch.tensor([context + target], dtype=torch.long, device=device)
        if ids.shape[1] > model.config.max_position_embeddings:
            ids = ids[:, -model.config.max_position_embeddings:]
        logits = full_logits(model, ids[:, :-1])[0, -len(target):, :vocab]
        predicted = logits.argmax(dim=-1).tolist()
        hits += int(predicted == target)
    return hits / len(texts)

