"""GPT-2's byte-level BPE tokenizer, reading the original ``vocab.json`` and ``merges.txt``.

Text is split with GPT-2's pre-tokenisation pattern, each piece's UTF-8 bytes are mapped to
printable characters (GPT-2's byte-to-unicode table), and merges are applied lowest rank first. The
ids are exactly those of OpenAI's encoder, and ``detokenize(tokenize(x)) == x`` for any text because
every byte has a symbol. ``<|endoftext|>`` is the end-of-document id.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import regex

END_OF_TEXT = "<|endoftext|>"
# GPT-2's pre-tokenisation: contractions, letter runs, digit runs, other symbols, whitespace.
PRETOKENIZE_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                       r"""|\s+(?!\S)|\s+""")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to 256, 257, ... in byte order,
    so no symbol is whitespace or a control character.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(next_code_point)
            next_code_point += 1
    return table


def _load_vocab(vocab_file: str) -> dict[str, int]:
    if not vocab_file:
        raise ValueError("GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json)")
    if not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"GPT-2 vocab file {vocab_file} does not exist; pass the path of "
                                f"vocab.json with --vocab-file")
    try:
        with open(vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"GPT-2 vocab file {vocab_file} is not valid JSON ({error}); it must be "
                         f"GPT-2's vocab.json, an object from token to id") from None
    if not isinstance(vocab, dict) or not all(
            isinstance(token, str) and isinstance(index, int) for token, index in vocab.items()):
        raise ValueError(f"GPT-2 vocab file {vocab_file} must be a JSON object mapping token "
                         f"strings to integer ids")
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"GPT-2 vocab file {vocab_file} maps two tokens to the same id")
    if END_OF_TEXT not in vocab:
        raise ValueError(f"GPT-2 vocab file {vocab_file} has no {END_OF_TEXT} token, which is "
                         f"the end-of-document id")
    return vocab


def _load_merges(merge_file: str) -> dict[tuple[str, str], int]:
    if not merge_file:
        raise ValueError("GPT2BPETokenizer needs --merge-file (GPT-2's merges.txt)")
    if not os.path.isfile(merge_file):
        raise FileNotFoundError(f"GPT-2 merge file {merge_file} does not exist; pass the path of "
                                f"merges.txt with --merge-file")
    ranks: dict[tuple[str, str], int] = {}
    with open(merge_file, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.rstrip("\r\n")
            if not line or (line_number == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"GPT-2 merge file {merge_file}, line {line_number}: expected two "
                                 f"symbols separated by one space, got {line!r}")
            ranks.setdefault((parts[0], parts[1]), len(ranks))
    return ranks


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` and ``merges.txt``."""

    def __init__(self, vocab_file: str, merge_file: str):
        self.vocab_file = vocab_file
        self.merge_file = merge_file
        self.encoder = _load_vocab(vocab_file)
        self.decoder = {index: token for token, index in self.encoder.items()}
        self.merge_ranks = _load_merges(merge_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {symbol: byte for byte, symbol in self.byte_encoder.items()}
        missing = [symbol for symbol in self.byte_encoder.values() if symbol not in self.encoder]
        if missing:
            raise ValueError(f"GPT-2 vocab file {vocab_file} lacks {len(missing)} of the 256 byte "
                             f"symbols (e.g. {missing[0]!r}); some text could not be encoded")
        self.pattern = regex.compile(PRETOKENIZE_PATTERN)
        self._eod = self.encoder[END_OF_TEXT]
        # Pieces repeat a lot in real text; caching their BPE is GPT-2's own speed trick.
        self._piece_cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        """Number of ids (GPT-2: 50257)."""
        return len(self.encoder)

    @property
    def eod(self) -> int:
        """Id of <|endoftext|>."""
        return self._eod

    @property
    def vocab(self) -> dict[str, int]:
        return self.encoder

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self.decoder

    def _bpe(self, piece: str) -> list[str]:
        """Merge the symbols of one pre-tokenised piece, lowest merge rank first."""
        symbols = list(piece)
        ranks = self.merge_ranks
        while len(symbols) > 1:
            best_rank, best_pair = None, None
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_pair = rank, pair
            if best_pair is None:
                break
            first, second = best_pair
            merged: list[str] = []
            position = 0
            while position < len(symbols):
                if (position < len(symbols) - 1 and symbols[position] == first
                        and symbols[position + 1] == second):
                    merged.append(first + second)
                    position += 2
                else:
                    merged.append(symbols[position])
                    position += 1
            symbols = merged
        return symbols

    def _encode_piece(self, piece: str) -> list[int]:
        cached = self._piece_cache.get(piece)
        if cached is not None:
            return cached
        mapped = "".join(self.byte_encoder[byte] for byte in piece.encode("utf-8"))
        try:
            ids = [self.encoder[symbol] for symbol in self._bpe(mapped)]
        except KeyError as error:
            raise ValueError(f"merge result {error.args[0]!r} is not in {self.vocab_file}; "
                             f"vocab.json and merges.txt do not belong together") from None
        if len(self._piece_cache) < 200_000:
            self._piece_cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-document token is added)."""
        ids: list[int] = []
        for piece in self.pattern.findall(text):
            ids.extend(self._encode_piece(piece))
        return ids

    def detokenize(self, token_ids) -> str:
        """Text of ``token_ids``; invalid UTF-8 from a partial sequence becomes U+FFFD."""
        symbols = "".join(self.decoder[int(index)] for index in token_ids)
        return bytes(self.byte_decoder[symbol] for symbol in symbols).decode("utf-8",
                                                                              errors="replace")
