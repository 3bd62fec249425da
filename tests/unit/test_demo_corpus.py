"""tools/build_demo_corpus.py: builds offline from the standard library, is idempotent, and its
output feeds build_gpt_datasets and decodes back to the corpus text."""

import importlib.util
import json
import os

import numpy as np

from megatron.core.config import DataConfig, ModelConfig
from megatron.core.datasets.builder import build_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "build_demo_corpus", os.path.join(REPO, "tools", "build_demo_corpus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_corpus_builds_once_and_trains(tmp_path):
    tool = load_tool()
    output = str(tmp_path / "demo")
    messages = []
    flags = tool.build_demo_corpus(output, max_megabytes=0.3, vocab_size=400, log=messages.append)
    assert any("standard-library modules" in m for m in messages)
    for path in (flags["data_path"] + ".bin", flags["data_path"] + ".idx",
                 flags["tokenizer_model"], os.path.join(output, "corpus.jsonl")):
        assert os.path.isfile(path)
    stamp = os.path.getmtime(flags["data_path"] + ".bin")

    messages.clear()
    assert tool.build_demo_corpus(output, max_megabytes=0.3, vocab_size=400,
                                  log=messages.append) == flags
    assert any("up to date" in m for m in messages)
    assert os.path.getmtime(flags["data_path"] + ".bin") == stamp

    config = DataConfig(data_path=[flags["data_path"]], split="949,50,1",
                        tokenizer_type=flags["tokenizer_type"],
                        tokenizer_model=flags["tokenizer_model"])
    tokenizer = build_tokenizer(config, ModelConfig())
    assert tokenizer.vocab_size == 400
    train, valid, _ = build_gpt_datasets(config, 32, 1234, (100, 10, 1), tokenizer)
    assert len(train) == 100 and len(valid) == 10
    assert train[0]["text"].shape == (33,) and train[0]["text"].max() < 400

    # Every document decodes back to its corpus text exactly.
    dataset = IndexedDataset(flags["data_path"])
    with open(os.path.join(output, "corpus.jsonl"), encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    assert len(texts) == len(dataset) > 20
    for index in range(0, len(texts), 7):
        ids = dataset[index]
        assert int(ids[-1]) == tokenizer.eod
        assert tokenizer.detokenize(np.asarray(ids[:-1])) == texts[index]


def test_rebuild_when_settings_change(tmp_path):
    tool = load_tool()
    output = str(tmp_path / "demo")
    tool.build_demo_corpus(output, max_megabytes=0.2, vocab_size=400, log=lambda m: None)
    messages = []
    tool.build_demo_corpus(output, max_megabytes=0.2, vocab_size=420, log=messages.append)
    assert not any("up to date" in m for m in messages)
    assert build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                      tokenizer_model=os.path.join(output, "tokenizer.model")),
                           ModelConfig()).vocab_size == 420
