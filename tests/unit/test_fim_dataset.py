"""--fim-data (megatron/core/datasets/fim_dataset.py): the fill-in-the-middle rewrite of a sample
equals Megatron's definition (PSM / SPM order, rates 0 and 1, end-of-document segments, split
fragments, no-prefix), keeps the sample length, and depends only on (seed, split, index)."""

import json
import types

import numpy as np
import pytest

from megatron.core.datasets.fim_dataset import (FIMDataset, FIMSettings, fim_settings_from_config,
                                                fim_transform, sample_rng, special_token_id,
                                                validate_fim_options)
from megatron.training.arguments import parse_args
from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer

from data_helpers import gpt2_files

SPECIALS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<eod>", "<file>"]


class CharTokenizer:
    """One id per character (a-z, space), then the special tokens: the rewrite is exact text."""

    def __init__(self):
        letters = "abcdefghijklmnopqrstuvwxyz 0123456789"
        self.vocab = {char: index for index, char in enumerate(letters)}
        for token in SPECIALS:
            self.vocab[token] = len(self.vocab)
        self.inverse = {index: char for char, index in self.vocab.items()}

    def tokenize(self, text):
        return [self.vocab[char] for char in text]

    def detokenize(self, ids):
        return "".join(self.inverse[int(i)] for i in ids)


TOKENIZER = CharTokenizer()
P, M, S, PAD, EOD, FILE = (TOKENIZER.vocab[token] for token in SPECIALS)


def settings(rate=1.0, spm_rate=0.0, **extra):
    return FIMSettings(rate=rate, spm_rate=spm_rate, prefix_id=P, middle_id=M, suffix_id=S,
                       pad_id=PAD, eod_id=EOD, **extra)


def ids(text):
    return np.asarray(TOKENIZER.tokenize(text), dtype=np.int64)


def expected_permutation(text, rate, spm_rate, rng):
    """Megatron's _permute, written from its definition for a character tokenizer."""
    if not rng.binomial(1, rate):
        return list(ids(text))
    first, second = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
    prefix, middle, suffix = text[:first], text[first:second], text[second:]
    if rng.binomial(1, spm_rate):
        return [P, S, *ids(suffix), M, *ids(prefix), *ids(middle)]
    return [P, *ids(prefix), S, *ids(suffix), M, *ids(middle)]


@pytest.mark.parametrize("spm_rate", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("seed", range(6))
def test_one_segment_is_rewritten_as_defined(spm_rate, seed):
    text = "the quick brown fox jumps"
    sample = ids(text)
    got = fim_transform(sample, settings(1.0, spm_rate), TOKENIZER, np.random.RandomState(seed))
    rewritten = expected_permutation(text, 1.0, spm_rate, np.random.RandomState(seed))
    assert got.tolist() == rewritten[:len(sample)]  # three sentinels more: cut to the length
    assert got.dtype == np.int64 and got.shape == sample.shape
    if spm_rate == 0.0:  # PSM
        assert got[0] == P and S in got and M in got
    if spm_rate == 1.0:  # SPM
        assert got[:2].tolist() == [P, S]


def test_psm_holds_the_whole_text_in_prefix_middle_suffix_pieces():
    text = "abcdefghij"
    sample = np.concatenate([ids(text), [PAD, PAD, PAD]])  # room for the sentinels
    for seed in range(20):
        got = fim_transform(sample, settings(), TOKENIZER, np.random.RandomState(seed)).tolist()
        s_at, m_at = got.index(S), got.index(M)
        prefix, suffix, middle = got[1:s_at], got[s_at + 1:m_at], got[m_at + 1:]
        assert TOKENIZER.detokenize(prefix + middle + suffix) == text


def test_rate_zero_leaves_the_sample_unchanged_and_rate_one_always_rewrites():
    sample = np.concatenate([ids("hello world"), [EOD], ids("second doc"), [EOD], ids("third")])
    for seed in range(10):
        rng = np.random.RandomState(seed)
        assert fim_transform(sample, settings(rate=0.0), TOKENIZER, rng).tolist() == \
            sample.tolist()
        got = fim_transform(sample, settings(rate=1.0), TOKENIZER, np.random.RandomState(seed))
        assert got[0] == P and got.shape == sample.shape


def test_segments_between_end_of_document_tokens_are_rewritten_one_by_one():
    texts = ["alpha beta", "gamma", "delta epsilon"]
    sample = np.concatenate([ids(texts[0]), [EOD], ids(texts[1]), [EOD], ids(texts[2])])
    got = fim_transform(sample, settings(spm_rate=0.5), TOKENIZER, np.random.RandomState(3))
    rng = np.random.RandomState(3)
    expected = []
    for index, text in enumerate(texts):
        expected += expected_permutation(text, 1.0, 0.5, rng)
        if index < 2:
            expected.append(EOD)
    assert got.tolist() == expected[:len(sample)]


def test_an_empty_segment_loses_its_end_of_document_token_and_the_sample_is_padded():
    sample = np.concatenate([ids("abc"), [EOD, EOD], ids("de")])
    got = fim_transform(sample, settings(rate=0.0), TOKENIZER, np.random.RandomState(0))
    assert got.tolist() == [*ids("abc"), EOD, *ids("de"), PAD]


def test_split_sample_rewrites_each_fragment_with_the_fragment_rate():
    text_a, text_b = "first file", "second file"
    sample = np.concatenate([ids(text_a), [FILE], ids(text_b), [PAD] * 6])
    fim = settings(rate=1.0, split_sample_id=FILE, fragment_rate=1.0)
    got = fim_transform(sample, fim, TOKENIZER, np.random.RandomState(5)).tolist()
    rng = np.random.RandomState(5)
    assert rng.binomial(1, 1.0)  # the sample-level draw
    first = expected_permutation(text_a, 1.0, 0.0, rng)
    # the padding after the last fragment is part of its text here: it is a special token, left
    # out of the text (Megatron detokenises without special tokens)
    second = expected_permutation(text_b, 1.0, 0.0, rng)
    assert got == (first + [FILE] + second + [PAD] * 20)[:len(sample)]
    assert got[got.index(FILE) + 1] == P
    # fragment rate 0: the fragments stay as they are
    keep = settings(rate=1.0, split_sample_id=FILE, fragment_rate=0.0)
    assert fim_transform(sample, keep, TOKENIZER, np.random.RandomState(5)).tolist() == \
        sample.tolist()


def test_no_prefix_leaves_matching_segments_unchanged():
    sample = np.concatenate([ids("skip me"), [EOD], ids("change me")])
    got = fim_transform(sample, settings(no_prefix="skip"), TOKENIZER, np.random.RandomState(1))
    assert got[:8].tolist() == [*ids("skip me"), EOD]
    assert got[8] == P


def test_a_sample_depends_only_on_seed_split_and_index():
    documents = [np.concatenate([ids(f"document number {i} text"), [EOD]]) for i in range(8)]
    inner = [{"text": documents[i]} for i in range(8)]
    dataset = FIMDataset(inner, settings(rate=0.5, spm_rate=0.5), TOKENIZER, 1234, "train")
    forwards = [dataset[i]["text"].tolist() for i in range(8)]
    backwards = [dataset[i]["text"].tolist() for i in reversed(range(8))][::-1]
    assert forwards == backwards  # read order does not matter (unlike Megatron's shared stream)
    again = FIMDataset(inner, settings(rate=0.5, spm_rate=0.5), TOKENIZER, 1234, "train")
    assert [again[i]["text"].tolist() for i in range(8)] == forwards
    other = FIMDataset(inner, settings(rate=0.5, spm_rate=0.5), TOKENIZER, 99, "train")
    assert [other[i]["text"].tolist() for i in range(8)] != forwards
    assert sample_rng(1, "train", 3).randint(1 << 30) == sample_rng(1, "train", 3).randint(1 << 30)
    assert all(len(sample) == len(documents[0]) for sample in forwards)


def test_gpt2_vocabulary_without_fim_tokens_is_refused_with_the_fix(tmp_path):
    vocab, merges = gpt2_files(tmp_path)
    tokenizer = GPT2BPETokenizer(vocab, merges)
    assert special_token_id(tokenizer, "<|endoftext|>", "--fim-eod-token") == tokenizer.eod
    with pytest.raises(ValueError, match="no token '<fim_prefix>' .*--fim-prefix-token"):
        special_token_id(tokenizer, "<fim_prefix>", "--fim-prefix-token")


def test_gpt2_vocabulary_with_fim_tokens_rewrites_text(tmp_path):
    vocab_path, merges = gpt2_files(tmp_path)
    vocab = json.loads(open(vocab_path, encoding="utf-8").read())
    for token in ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"):
        vocab[token] = len(vocab)
    open(vocab_path, "w", encoding="utf-8").write(json.dumps(vocab))
    tokenizer = GPT2BPETokenizer(vocab_path, merges)
    data = types.SimpleNamespace(fim_rate=1.0, fim_spm_rate=0.0, fim_split_sample=None,
                                 fim_fragment_rate=None, fim_no_prefix=None,
                                 fim_prefix_token="<fim_prefix>", fim_middle_token="<fim_middle>",
                                 fim_suffix_token="<fim_suffix>", fim_pad_token="<fim_pad>",
                                 fim_eod_token="<|endoftext|>")
    fim = fim_settings_from_config(data, tokenizer)
    sample = np.asarray(tokenizer.tokenize("the cat sat on the mat") + [tokenizer.eod] * 4)
    got = fim_transform(sample, fim, tokenizer, np.random.RandomState(0)).tolist()
    assert got[0] == vocab["<fim_prefix>"] and vocab["<fim_middle>"] in got
    pieces = [i for i in got if i not in fim.special_ids()]
    assert sorted(tokenizer.detokenize(pieces)) == sorted("the cat sat on the mat")


def _fim_argv(*extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--lr", "1e-3", "--train-iters", "1", "--data-path", "x", "--vocab-file", "v.json",
            "--merge-file", "m.txt", "--fim-data", *extra]


def test_flags_parse_and_bad_values_are_refused_with_the_fix():
    config = parse_args(_fim_argv("--fim-rate", "0.25", "--fim-spm-rate", "1",
                                  "--fim-split-sample", "<file>", "--fim-fragment-rate", "0.5"),
                        world_size=1)
    assert (config.data.fim_data, config.data.fim_rate, config.data.fim_spm_rate,
            config.data.fim_split_sample, config.data.fim_fragment_rate) == \
        (True, 0.25, 1.0, "<file>", 0.5)
    with pytest.raises(ValueError, match=r"--fim-rate 1.5 is not a probability; give a value"):
        parse_args(_fim_argv("--fim-rate", "1.5"), world_size=1)
    with pytest.raises(ValueError, match="--fim-split-sample needs --fim-fragment-rate"):
        parse_args(_fim_argv("--fim-split-sample", "<file>"), world_size=1)
    data = types.SimpleNamespace(fim_data=True, mock_data=True)
    with pytest.raises(ValueError, match="--mock-data"):
        validate_fim_options(data)
