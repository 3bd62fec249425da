"""Fill-in-the-middle (FIM) samples: Megatron-LM's ``--fim-data`` (its ``GPTFIMDataset``).

:class:`FIMDataset` wraps a GPT dataset (or a blend of them) and rewrites each sample of
``seq_length + 1`` tokens as Megatron does:

- the sample is cut at its end-of-document tokens (``--fim-eod-token``); each non-empty segment is
  transformed and the segments are joined again with one end-of-document token between them (an
  empty segment, i.e. two adjacent end-of-document tokens, loses its token, as in Megatron);
- a segment is transformed with probability ``--fim-rate``: its text (the detokenised ids, FIM and
  end-of-document tokens left out) is cut at two character positions drawn uniformly from
  ``[0, len(text)]`` into prefix, middle and suffix, each piece is tokenised again, and the segment
  becomes, with probability ``--fim-spm-rate``, SPM order
  ``<prefix> <suffix> suffix <middle> prefix middle``, otherwise PSM order
  ``<prefix> prefix <suffix> suffix <middle> middle``;
- with ``--fim-split-sample TOKEN`` a segment holding that token is first cut at it into fragments
  (e.g. the files of a repository): with probability ``--fim-rate`` each fragment is then transformed
  with probability ``--fim-fragment-rate``, and the fragments are joined with the split token again;
- a segment whose text starts with ``--fim-no-prefix`` is left unchanged;
- the rewritten sample is cut to its original length or padded with ``--fim-pad-token``.

One deliberate difference: Megatron draws every random number from one generator shared by all
samples, so a sample's tokens depend on which samples were read before it (and on the data-loader
workers). Here each sample draws from its own generator, seeded by ``(--seed, split, sample
index)``, so a sample is the same in every parallel layout, after resuming, and on every read.
Megatron also maps a FIM token that the vocabulary lacks to the unknown token (for GPT-2 that is
``<|endoftext|>``); here a missing token is an error that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from megatron.core.tensor_parallel.random import stable_seed

FIM_TOKEN_FLAGS = (("prefix", "--fim-prefix-token"), ("middle", "--fim-middle-token"),
                   ("suffix", "--fim-suffix-token"), ("pad", "--fim-pad-token"),
                   ("eod", "--fim-eod-token"))


@dataclass(frozen=True)
class FIMSettings:
    """The FIM transform's rates and token ids (see the module docstring)."""

    rate: float
    spm_rate: float
    prefix_id: int
    middle_id: int
    suffix_id: int
    pad_id: int
    eod_id: int
    split_sample_id: Optional[int] = None
    fragment_rate: Optional[float] = None
    no_prefix: Optional[str] = None

    def special_ids(self) -> set[int]:
        """Ids left out of a segment's text (Megatron detokenises without special tokens)."""
        ids = {self.prefix_id, self.middle_id, self.suffix_id, self.pad_id, self.eod_id}
        return ids | ({self.split_sample_id} if self.split_sample_id is not None else set())


def validate_fim_options(data_config) -> None:
    """Rules of the ``--fim-*`` flags (with ``--fim-data``); raises ValueError naming the fix."""
    if not getattr(data_config, "fim_data", False):
        return
    if data_config.mock_data:
        raise ValueError("--fim-data rewrites real text and does not work with --mock-data; give "
                         "--data-path and a text tokenizer instead")
    if data_config.tokenizer_type == "NullTokenizer":
        raise ValueError("--fim-data cuts each sample's text into pieces and tokenises them again, "
                         "which the NullTokenizer cannot do; use GPT2BPETokenizer or a "
                         "SentencePiece tokenizer")
    for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(data_config, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} {value} is not a probability; give a "
                             f"value in [0, 1]")
    if data_config.fim_split_sample is not None and data_config.fim_fragment_rate is None:
        raise ValueError("--fim-split-sample needs --fim-fragment-rate (the FIM probability of "
                         "each fragment)")
    for _, flag in FIM_TOKEN_FLAGS:
        if not getattr(data_config, flag[2:].replace("-", "_")):
            raise ValueError(f"{flag} is empty; name the tokenizer's token for it")


def special_token_id(tokenizer: Any, token: str, flag: str) -> int:
    """The id of the single vocabulary entry ``token`` (a FIM or split token) of ``tokenizer``."""
    vocab = getattr(tokenizer, "vocab", None)
    processor = getattr(tokenizer, "processor", None)
    if isinstance(vocab, dict):  # GPT-2 BPE: vocab.json entries
        if token in vocab:
            return int(vocab[token])
    elif processor is not None:  # SentencePiece: a piece of the model
        piece_id = int(processor.piece_to_id(token))
        if processor.id_to_piece(piece_id) == token and piece_id != processor.unk_id():
            return piece_id
    else:
        raise ValueError(f"--fim-data needs a tokenizer with text and a vocabulary "
                         f"({type(tokenizer).__name__} has none); use GPT2BPETokenizer or a "
                         f"SentencePiece tokenizer")
    raise ValueError(f"the tokenizer's vocabulary has no token {token!r} ({flag}); FIM needs "
                     f"its special tokens as single vocabulary entries: use a vocabulary (or "
                     f"SentencePiece model) that holds them, or name existing ones with {flag}")


def fim_settings_from_config(data_config, tokenizer) -> FIMSettings:
    """:class:`FIMSettings` from the ``--fim-*`` flags and the tokenizer's vocabulary."""
    if tokenizer is None:
        raise ValueError("--fim-data needs the run's tokenizer (--vocab-file/--merge-file or "
                         "--tokenizer-model)")
    ids = {role: special_token_id(tokenizer, getattr(data_config, flag[2:].replace("-", "_")),
                                  flag) for role, flag in FIM_TOKEN_FLAGS}
    split_id = None
    if data_config.fim_split_sample is not None:
        split_id = special_token_id(tokenizer, data_config.fim_split_sample, "--fim-split-sample")
    return FIMSettings(rate=data_config.fim_rate, spm_rate=data_config.fim_spm_rate,
                       prefix_id=ids["prefix"], middle_id=ids["middle"], suffix_id=ids["suffix"],
                       pad_id=ids["pad"], eod_id=ids["eod"], split_sample_id=split_id,
                       fragment_rate=data_config.fim_fragment_rate,
                       no_prefix=data_config.fim_no_prefix)


def permute_segment(segment: np.ndarray, rate: float, settings: FIMSettings, tokenizer,
                    rng: np.random.RandomState) -> np.ndarray:
    """With probability ``rate``: ``segment`` in PSM or SPM order (Megatron's ``_permute``)."""
    if not rng.binomial(1, rate):
        return segment
    special = settings.special_ids()
    text = tokenizer.detokenize([int(i) for i in segment if int(i) not in special])
    if settings.no_prefix is not None and text.startswith(settings.no_prefix):
        return segment
    first, second = sorted(int(b) for b in rng.randint(low=0, high=len(text) + 1, size=2))
    prefix, middle, suffix = (np.asarray(tokenizer.tokenize(piece), dtype=np.int64) for piece in
                              (text[:first], text[first:second], text[second:]))
    s = settings
    if rng.binomial(1, s.spm_rate):
        parts = [[s.prefix_id, s.suffix_id], suffix, [s.middle_id], prefix, middle]
    else:
        parts = [[s.prefix_id], prefix, [s.suffix_id], suffix, [s.middle_id], middle]
    return np.concatenate([np.asarray(part, dtype=np.int64) for part in parts])


def _split_and_permute(segment: np.ndarray, settings: FIMSettings, tokenizer,
                       rng: np.random.RandomState) -> np.ndarray:
    """A segment, cut into fragments at ``--fim-split-sample`` first when it holds that token."""
    split = settings.split_sample_id
    breaks = [] if split is None else np.flatnonzero(segment == split).tolist()
    if not breaks:
        return permute_segment(segment, settings.rate, settings, tokenizer, rng)
    if not rng.binomial(1, settings.rate):
        return segment
    fragment_rate = settings.fragment_rate if settings.fragment_rate is not None else 0.0
    pieces, start = [], 0
    for position in breaks:
        if position > start:
            pieces += [permute_segment(segment[start:position], fragment_rate, settings,
                                       tokenizer, rng), np.asarray([split], dtype=np.int64)]
        start = position + 1
    pieces.append(permute_segment(segment[start:], fragment_rate, settings, tokenizer, rng))
    return np.concatenate(pieces)


def fim_transform(sample: np.ndarray, settings: FIMSettings, tokenizer,
                  rng: np.random.RandomState) -> np.ndarray:
    """``sample`` rewritten for FIM, cut or padded to its own length (int64)."""
    sample = np.asarray(sample, dtype=np.int64)
    breaks = np.flatnonzero(sample == settings.eod_id).tolist()
    if breaks:
        pieces, start = [], 0
        for position in breaks:
            if position > start:  # an empty segment is dropped with its end-of-document token
                pieces += [_split_and_permute(sample[start:position], settings, tokenizer, rng),
                           np.asarray([settings.eod_id], dtype=np.int64)]
            start = position + 1
        pieces.append(_split_and_permute(sample[start:], settings, tokenizer, rng))
        result = np.concatenate(pieces)
    else:
        result = _split_and_permute(sample, settings, tokenizer, rng)
    if result.shape[0] >= sample.shape[0]:
        return result[:sample.shape[0]].astype(np.int64)
    padding = np.full(sample.shape[0] - result.shape[0], settings.pad_id, dtype=np.int64)
    return np.concatenate([result, padding]).astype(np.int64)


def sample_rng(seed: int, split_name: str, index: int) -> np.random.RandomState:
    """The generator of sample ``index`` of a split: a function of the seed, split and index only."""
    return np.random.RandomState(stable_seed(seed, "fim", split_name, index) % 2 ** 32)


class FIMDataset:
    """A GPT dataset whose samples (``{"text": int64[seq_length + 1]}``) are FIM-rewritten."""

    def __init__(self, dataset, settings: FIMSettings, tokenizer, seed: int, split_name: str):
        self.dataset = dataset
        self.settings = settings
        self.tokenizer = tokenizer
        self.seed = int(seed)
        self.split_name = split_name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        sample = dict(self.dataset[index])
        sample["text"] = fim_transform(sample["text"], self.settings, self.tokenizer,
                                       sample_rng(self.seed, self.split_name, int(index)))
        return sample


def wrap_fim_datasets(datasets, data_config, tokenizer, seed: int,
                      split_names=("train", "valid", "test")) -> tuple:
    """``datasets`` (train, valid, test; None kept) wrapped in :class:`FIMDataset`."""
    settings = fim_settings_from_config(data_config, tokenizer)
    return tuple(None if dataset is None else FIMDataset(dataset, settings, tokenizer, seed, name)
                 for dataset, name in zip(datasets, split_names))
