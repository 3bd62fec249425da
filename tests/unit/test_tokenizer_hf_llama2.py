"""--tokenizer-type Llama2Tokenizer and HuggingFaceTokenizer with Megatron-LM's semantics, on
tokenizers built offline in the test: a tiny SentencePiece model trained here, and a tiny Hugging
Face tokenizer (word-level, beginning-of-sentence added by its post-processor) saved with
transformers; and tools/preprocess_data.py writes datasets with both."""

import importlib.util
import json
import os

import pytest

from megatron.core.config import DataConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import (HuggingFaceTokenizer, Llama2Tokenizer,
                                         SentencePieceTokenizer, build_tokenizer)
from megatron.training.tokenizer.sentencepiece_training import train_sentencepiece
from test_tokenizer_sentencepiece import synthetic_documents

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "and", "bird"]
TEXTS = ["the cat sat on the mat", "a dog and the bird", "the bird sat"]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "tok"
    return train_sentencepiece(synthetic_documents(), str(prefix), vocab_size=320)


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {token: index for index, token in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    directory = tmp_path_factory.mktemp("hf") / "tiny-tokenizer"
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def test_llama2_puts_bos_first_and_no_eos(spm_model):
    tokenizer = Llama2Tokenizer(spm_model)
    plain = SentencePieceTokenizer(spm_model)
    assert (tokenizer.vocab_size, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (320, 1, 2, 2)
    assert tokenizer.pad == -1  # no pad piece, like Llama 2's model
    for text in synthetic_documents(10, seed=3):
        ids = tokenizer.tokenize(text)
        assert ids == [1] + plain.tokenize(text)
        assert tokenizer.tokenize(text, bos=False, eos=True) == plain.tokenize(text) + [2]
        assert tokenizer.detokenize(ids) == text  # the bos piece decodes to nothing
    built = build_tokenizer(DataConfig(tokenizer_type="Llama2Tokenizer",
                                       tokenizer_model=spm_model))
    assert isinstance(built, Llama2Tokenizer) and built.tokenize("the data") == \
        tokenizer.tokenize("the data")


def test_hugging_face_tokenizer_from_a_local_directory(hf_directory):
    tokenizer = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                           tokenizer_model=hf_directory))
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert tokenizer.vocab_size == 3 + len(WORDS)
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad) == (2, 1, None)
    ids = tokenizer.tokenize("the cat sat")
    assert ids == [1, 3, 4, 5]  # the tokenizer's own special tokens included, as Megatron
    assert tokenizer.detokenize(ids[1:]) == "the cat sat"
    assert tokenizer.vocab["mat"] == 7


def test_a_hub_name_without_internet_says_how_to_fix_it(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"nonexistent-org/no-such-tokenizer is neither a local "
                                         r"tokenizer directory.*Fix:.*--tokenizer-model DIR"):
        HuggingFaceTokenizer("nonexistent-org/no-such-tokenizer")


def test_a_directory_that_is_no_tokenizer_is_named(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="is a directory but not a Hugging Face tokenizer"):
        HuggingFaceTokenizer(str(tmp_path))


def _preprocess(tmp_path, name, *tokenizer_flags):
    spec = importlib.util.spec_from_file_location(
        "preprocess_data", os.path.join(REPO, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    prefix = tmp_path / name
    assert module.main(["--input", str(corpus), "--output-prefix", str(prefix), "--append-eod",
                        *tokenizer_flags]) == 0
    return IndexedDataset(f"{prefix}_text_document")


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "HuggingFaceTokenizer"])
def test_preprocess_data_takes_them(tmp_path, kind, spm_model, hf_directory):
    model = spm_model if kind == "Llama2Tokenizer" else hf_directory
    dataset = _preprocess(tmp_path, kind, "--tokenizer-type", kind, "--tokenizer-model", model)
    tokenizer = build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=model))
    assert len(dataset) == len(TEXTS)
    for index, text in enumerate(TEXTS):
        assert dataset[index].tolist() == tokenizer.tokenize(text) + [tokenizer.eod]
