"""Null tokenizer for text that already is space-separated token ids (Megatron's NullTokenizer).

With ``--vocab-size V`` the ids are 0..V-1 and the end-of-document id is V, so ``vocab_size`` is
V + 1, as in Megatron.
"""

from __future__ import annotations


class NullTokenizer:
    """Ids in, ids out."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError("NullTokenizer needs --vocab-size (a positive number of token ids)")
        self._vocab_size_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    def tokenize(self, text: str) -> list[int]:
        """``"3 1 4"`` -> ``[3, 1, 4]``."""
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer expects space-separated integers, got {text[:60]!r}") \
                from None
        for index in ids:
            if not 0 <= index <= self._vocab_size_without_eod:
                raise ValueError(f"token id {index} outside 0..{self._vocab_size_without_eod} "
                                 f"(--vocab-size {self._vocab_size_without_eod})")
        return ids

    def detokenize(self, token_ids) -> str:
        return " ".join(str(int(index)) for index in token_ids)
