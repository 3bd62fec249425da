"""Offline training of a SentencePiece BPE model from documents (used by tools/train_tokenizer.py
and tools/build_demo_corpus.py).

The settings keep ``decode(encode(text)) == text`` for any text: identity normalisation, whitespace
kept as is (indentation matters in code), newline as its own piece and byte fallback for characters
the vocabulary lacks. Ids 0, 1, 2 are <unk>, <s>, </s>; </s> is the end-of-document id.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

# SentencePiece drops training sentences longer than max_sentence_length bytes, so long documents are
# fed in chunks of at most this many characters (4 bytes each at worst).
_CHUNK_CHARACTERS = 2000
_MAX_SENTENCE_BYTES = 4 * _CHUNK_CHARACTERS


def _chunks(documents: Iterable[str]) -> Iterator[str]:
    for document in documents:
        for start in range(0, len(document), _CHUNK_CHARACTERS):
            chunk = document[start:start + _CHUNK_CHARACTERS]
            if chunk.strip():
                yield chunk


def train_sentencepiece(documents: Iterable[str], output_prefix: str, vocab_size: int = 8000,
                        model_type: str = "bpe", num_threads: int = 2,
                        character_coverage: float = 0.9995) -> str:
    """Train a model on ``documents``; writes ``OUTPUT_PREFIX.model`` and ``.vocab``, returns the
    model path."""
    import sentencepiece

    if vocab_size < 260:
        raise ValueError(f"--vocab-size {vocab_size} is too small: the byte fallback alone needs 256 "
                         f"pieces plus <unk>, <s>, </s> and newline; use at least 260")
    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_chunks(documents),
            model_prefix=output_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            user_defined_symbols=["\n"],
            max_sentence_length=_MAX_SENTENCE_BYTES,
            character_coverage=character_coverage,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as error:
        raise ValueError(f"SentencePiece training failed: {error}. Raise --vocab-size when it "
                         f"is below the characters the corpus needs; lower it when the corpus "
                         f"is too small for that many pieces") from None
    return output_prefix + ".model"
