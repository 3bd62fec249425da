"""SentencePiece: offline training, exact round trip, eod, and errors naming the model file."""

import random

import pytest

from megatron.core.config import DataConfig, ModelConfig
from megatron.training.tokenizer import (
    GPTSentencePieceTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)
from megatron.training.tokenizer.sentencepiece_training import train_sentencepiece


def synthetic_documents(count=300, seed=0):
    rng = random.Random(seed)
    words = ["def", "return", "class", "self", "value", "index", "print", "the", "data", "model",
             "über", "日本", "(", ")", ":", "=", "+", "0", "1", "42"]
    documents = []
    for _ in range(count):
        lines = []
        for _ in range(rng.randint(1, 8)):
            indent = "    " * rng.randint(0, 2)
            lines.append(indent + " ".join(rng.choice(words) for _ in range(rng.randint(1, 10))))
        documents.append("\n".join(lines))
    return documents


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "tok"
    return train_sentencepiece(synthetic_documents(), str(prefix), vocab_size=320)


def test_round_trip_and_eod(model_file):
    tokenizer = SentencePieceTokenizer(model_file)
    assert tokenizer.vocab_size == 320
    assert tokenizer.eod == 2
    rng = random.Random(1)
    alphabet = "abc def\n\n    return x  +\t1 üé日本🙂 ~|"
    for text in synthetic_documents(20, seed=5) + [
            "".join(rng.choice(alphabet) for _ in range(50)) for _ in range(50)]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text


def test_build_tokenizer_sentencepiece(model_file):
    config = DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model_file)
    tokenizer = build_tokenizer(config, ModelConfig())
    assert tokenizer.detokenize(tokenizer.tokenize("return self")) == "return self"


def test_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.model"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(ValueError, match="garbage.model"):
        SentencePieceTokenizer(str(garbage))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        SentencePieceTokenizer(None)
    with pytest.raises(ValueError, match="vocab-size"):
        train_sentencepiece(["abc"], str(tmp_path / "tiny"), vocab_size=100)


def test_gpt_sentencepiece_tokenizer_matches_megatrons_definition(model_file):
    """Megatron's GPTSentencePieceTokenizer adds no special tokens: its vocabulary is the model's
    piece count, its ids are the model's plain encoding, and its eod is the model's eos id."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    processor.Load(model_file)
    config = DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model_file)
    tokenizer = build_tokenizer(config, ModelConfig())
    assert type(tokenizer).__name__ == "GPTSentencePieceTokenizer"
    assert tokenizer.vocab_size == processor.get_piece_size() == 320
    assert tokenizer.eod == processor.eos_id() == processor.piece_to_id("</s>")
    assert tokenizer.eod != processor.bos_id()
    for text in synthetic_documents(20, seed=7):
        ids = tokenizer.tokenize(text)
        assert ids == processor.encode_as_ids(text)
        assert tokenizer.eod not in ids
        assert tokenizer.detokenize(ids) == processor.decode_ids(ids) == text
    with pytest.raises(ValueError, match="GPTSentencePieceTokenizer needs --tokenizer-model"):
        GPTSentencePieceTokenizer(None)


def test_gpt_sentencepiece_tokenizer_flags_validate_and_need_a_model(model_file):
    from megatron.training.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--data-path", "x", "--tokenizer-type",
            "GPTSentencePieceTokenizer"]
    config = parse_args(base + ["--tokenizer-model", model_file])
    assert config.data.tokenizer_type == "GPTSentencePieceTokenizer"
    assert config.model.padded_vocab_size is None  # read from the model file once it is built
    with pytest.raises(ValueError, match="GPTSentencePieceTokenizer needs --tokenizer-model"):
        parse_args(base)
