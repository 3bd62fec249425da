"""Tokenizers: GPT-2 byte-level BPE, SentencePiece (plain, GPT and Llama 2 flavours), Hugging Face
(``transformers.AutoTokenizer``) and the null tokenizer, and ``build_tokenizer``.

Every tokenizer has ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]`` and
``detokenize(ids) -> str``. The model pads ``vocab_size`` elsewhere.
"""

from __future__ import annotations

from megatron.training.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.training.tokenizer.null_tokenizer import NullTokenizer
from megatron.training.tokenizer.sentencepiece_tokenizer import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(data_config, model_config=None):
    """The tokenizer named by ``data_config.tokenizer_type`` with its files.

    ``data_config`` is a :class:`megatron.core.config.DataConfig` (or anything with its fields);
    ``model_config.vocab_size`` is read for the NullTokenizer only.
    """
    tokenizer_type = data_config.tokenizer_type
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(data_config.vocab_file, data_config.merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(data_config.tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(data_config.tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(data_config.tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(data_config.tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        vocab_size = getattr(model_config, "vocab_size", None) if model_config is not None else None
        return NullTokenizer(vocab_size)
    if tokenizer_type is None:
        raise ValueError(f"no tokenizer given: pass --tokenizer-type, one of {TOKENIZER_TYPES}")
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {TOKENIZER_TYPES}")


__all__ = ["GPT2BPETokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
           "Llama2Tokenizer", "NullTokenizer", "SentencePieceTokenizer", "TOKENIZER_TYPES",
           "build_tokenizer"]
