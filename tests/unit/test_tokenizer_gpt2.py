"""GPT-2 byte-level BPE on a small hand-built vocabulary: known ids, merge order, round trip, eod,
and clear errors for missing or malformed files."""

import json
import random

import pytest

from megatron.core.config import DataConfig, ModelConfig
from megatron.training.tokenizer import GPT2BPETokenizer, NullTokenizer, build_tokenizer
from megatron.training.tokenizer.gpt2_bpe import PRETOKENIZE_PATTERN, bytes_to_unicode

import regex

# Merges in rank order; each merged symbol gets the next id after the 256 byte symbols.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("e", "l"), ("l", "l"), ("Ġ", "w"), ("o", "r")]


def write_vocab_files(directory, merges=MERGES, with_eod=True, header=True):
    """vocab.json: byte symbol of byte b has id b, merges follow, then <|endoftext|>."""
    table = bytes_to_unicode()
    vocab = {table[byte]: byte for byte in range(256)}
    for first, second in merges:
        vocab[first + second] = len(vocab)
    if with_eod:
        vocab["<|endoftext|>"] = len(vocab)
    vocab_file = directory / "vocab.json"
    merge_file = directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    lines = (["#version: 0.2"] if header else []) + [f"{a} {b}" for a, b in merges]
    merge_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(vocab_file), str(merge_file), vocab


@pytest.fixture
def tokenizer(tmp_path):
    vocab_file, merge_file, _ = write_vocab_files(tmp_path)
    return GPT2BPETokenizer(vocab_file, merge_file)


def test_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord("!")] == "!"
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"
    assert all(not symbol.isspace() for symbol in table.values())


def test_pretokenization_pattern():
    pieces = regex.findall(PRETOKENIZE_PATTERN, "Hello world's 123 !!  a\n\nb")
    assert pieces == ["Hello", " world", "'s", " 123", " !!", " ", " a", "\n", "\n", "b"]


def test_known_ids(tokenizer):
    # " the" merges Ġ+t (rank 0), h+e (1), Ġt+he (2) into one token, id 256 + 2.
    assert tokenizer.tokenize(" the") == [258]
    # "the" has no Ġ, so only h+e merges: [t, he].
    assert tokenizer.tokenize("the") == [ord("t"), 257]
    # "ell": e+l (rank 3) wins over l+l (rank 4), giving [el, l], not [e, ll].
    assert tokenizer.tokenize("ell") == [259, ord("l")]
    assert tokenizer.tokenize(" world") == [261, 262, ord("l"), ord("d")]
    # Non-ASCII text is its UTF-8 bytes.
    assert tokenizer.tokenize("日") == [0xE6, 0x97, 0xA5]


def test_eod_and_vocab_size(tokenizer):
    assert tokenizer.eod == 256 + len(MERGES)
    assert tokenizer.vocab_size == 256 + len(MERGES) + 1
    assert tokenizer.detokenize([tokenizer.eod]) == "<|endoftext|>"


def test_round_trip_on_arbitrary_unicode(tokenizer):
    alphabet = ("abc XYZ the hello world 0123 \t\n\r  \u00a0é日本語🙂🚀\u0301'sllve!?.,;:"
                "\u200b\u2028ß∑Ωқ\x00\x7f")
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_merge_file_without_version_header(tmp_path):
    vocab_file, merge_file, _ = write_vocab_files(tmp_path, header=False)
    assert GPT2BPETokenizer(vocab_file, merge_file).tokenize(" the") == [258]


def test_missing_files_name_the_file(tmp_path):
    vocab_file, merge_file, _ = write_vocab_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        GPT2BPETokenizer(str(tmp_path / "nope.json"), merge_file)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        GPT2BPETokenizer(vocab_file, str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="--vocab-file"):
        GPT2BPETokenizer(None, merge_file)


def test_malformed_files_name_the_file(tmp_path):
    vocab_file, merge_file, vocab = write_vocab_files(tmp_path)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        GPT2BPETokenizer(str(bad_json), merge_file)
    bad_merges = tmp_path / "bad.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree parts here\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.txt, line 3"):
        GPT2BPETokenizer(vocab_file, str(bad_merges))
    no_eod = dict(vocab)
    del no_eod["<|endoftext|>"]
    (tmp_path / "noeod.json").write_text(json.dumps(no_eod), encoding="utf-8")
    with pytest.raises(ValueError, match="noeod.json.*endoftext"):
        GPT2BPETokenizer(str(tmp_path / "noeod.json"), merge_file)
    no_bytes = {k: v for k, v in vocab.items() if k != "Ġ"}
    (tmp_path / "nobytes.json").write_text(json.dumps(no_bytes), encoding="utf-8")
    with pytest.raises(ValueError, match="nobytes.json.*byte symbols"):
        GPT2BPETokenizer(str(tmp_path / "nobytes.json"), merge_file)


def test_build_tokenizer(tmp_path):
    vocab_file, merge_file, _ = write_vocab_files(tmp_path)
    config = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                        merge_file=merge_file)
    assert build_tokenizer(config, ModelConfig()).tokenize(" the") == [258]
    null = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), ModelConfig(vocab_size=100))
    assert isinstance(null, NullTokenizer)
    with pytest.raises(ValueError, match="--tokenizer-type"):
        build_tokenizer(DataConfig(), ModelConfig())
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), ModelConfig())


def test_null_tokenizer_matches_megatron():
    tokenizer = NullTokenizer(100)
    assert tokenizer.vocab_size == 101 and tokenizer.eod == 100
    assert tokenizer.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.tokenize("3 101")
