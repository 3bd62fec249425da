"""SentencePiece tokenizers (``--tokenizer-type SentencePieceTokenizer`` or
``GPTSentencePieceTokenizer``, with ``--tokenizer-model M``).

Both use the model's pieces as they are, with no added special tokens, and take the end-of-document
id from the model's end-of-sentence piece (Megatron's GPTSentencePieceTokenizer), so a model must be
trained with one; ``tools/train_tokenizer.py`` does. Megatron's own SentencePieceTokenizer would
append <CLS>/<SEP>/<EOD>/<MASK> pieces; ours does not.
"""

from __future__ import annotations

import os


class SentencePieceTokenizer:
    """Wraps a trained SentencePiece model file."""

    def __init__(self, model_file: str):
        import sentencepiece

        if not model_file:
            raise ValueError(f"{type(self).__name__} needs --tokenizer-model (a SentencePiece "
                             ".model file; train one with tools/train_tokenizer.py)")
        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePiece model {model_file} does not exist; pass the "
                                    f".model file written by tools/train_tokenizer.py")
        self.model_file = model_file
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.Load(model_file)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"SentencePiece model {model_file} could not be loaded ({error}); "
                             f"it must be a .model file written by SentencePiece") from None
        self._eod = self.processor.eos_id()
        if self._eod < 0:
            raise ValueError(f"SentencePiece model {model_file} has no end-of-sentence piece, "
                             f"which is needed as the end-of-document id; retrain it with an eos "
                             f"piece (tools/train_tokenizer.py does this)")

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-document token is added)."""
        return self.processor.encode(text)

    def detokenize(self, token_ids) -> str:
        return self.processor.decode([int(index) for index in token_ids])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's ``GPTSentencePieceTokenizer``: the model's pieces only (vocabulary = piece count),
    ids from plain encoding, and end-of-document = the model's end-of-sentence id."""


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: a SentencePiece model (Llama 2's ``tokenizer.model``) whose
    ``tokenize`` puts the beginning-of-sentence id first and adds no end-of-sentence id (text
    completion, as Megatron's ``tokenize(s, bos=True, eos=False)``); the vocabulary is the piece
    count, end-of-document = end-of-sentence id, and ``bos`` / ``eos`` / ``pad`` are the model's
    ids (``pad`` is -1 when the model has no pad piece, like Llama 2's)."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.processor.bos_id() < 0:
            raise ValueError(f"SentencePiece model {model_file} has no beginning-of-sentence "
                             f"piece, which the Llama2Tokenizer puts before every text; use "
                             f"--tokenizer-type GPTSentencePieceTokenizer for such a model")

    @property
    def bos(self) -> int:
        return self.processor.bos_id()

    @property
    def eos(self) -> int:
        return self.processor.eos_id()

    @property
    def pad(self) -> int:
        return self.processor.pad_id()

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """``[bos] + ids(text)`` by default (``eos=True`` appends the end-of-sentence id)."""
        ids = self.processor.encode(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])
