"""tools/preprocess_data.py end to end on a small JSONL: Megatron's output names and format, EOD,
bad lines reported with their line numbers, identical output with several workers, strict mode."""

import importlib.util
import json
import os

import numpy as np
import pytest

from megatron.core.config import DataConfig
from megatron.core.datasets.builder import build_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import GPT2BPETokenizer
from data_helpers import gpt2_files

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOOD_TEXTS = ["the cat sat on the mat", "a dog\nand the bird", "日本語 text 🙂", "x" * 300]


def write_corpus(path, with_bad_lines=True):
    lines = [json.dumps({"text": GOOD_TEXTS[0], "meta": 1}).encode()]
    if with_bad_lines:
        lines += [b"{this is not json"]                       # line 2
    lines += [json.dumps({"text": GOOD_TEXTS[1]}).encode()]
    if with_bad_lines:
        lines += [json.dumps({"body": "no text key"}).encode(),   # line 4
                  json.dumps({"text": 42}).encode(),               # line 5
                  b'{"text": "\xff\xfe broken utf-8"}']            # line 6
    lines += [b"", json.dumps({"text": GOOD_TEXTS[2]}).encode(),
              json.dumps({"text": ""}).encode(), json.dumps({"text": GOOD_TEXTS[3]}).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")


def run_tool(tmp_path, corpus, prefix, *extra):
    vocab_file, merge_file = gpt2_files(tmp_path)
    return load_tool("preprocess_data").main([
        "--input", str(corpus), "--json-keys", "text", "--output-prefix", str(prefix),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
        "--merge-file", merge_file, "--append-eod", "--log-interval", "1", *extra])


def test_end_to_end_with_bad_lines(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    assert run_tool(tmp_path, corpus, tmp_path / "out" / "corpus") == 0
    messages = capsys.readouterr().err
    for line_number, reason in [(2, "invalid JSON"), (4, "missing key 'text'"),
                                (5, "'text' is a int"), (6, "invalid UTF-8")]:
        assert f"line {line_number}: {reason}" in messages
    assert "skipped 4 bad lines" in messages and "docs/s" in messages and "MB/s" in messages

    tokenizer = GPT2BPETokenizer(*gpt2_files(tmp_path))
    dataset = IndexedDataset(str(tmp_path / "out" / "corpus_text_document"))
    assert dataset.dtype == np.uint16
    assert len(dataset) == len(GOOD_TEXTS)  # the empty document is skipped
    for index, text in enumerate(GOOD_TEXTS):
        ids = dataset[index].tolist()
        assert ids == tokenizer.tokenize(text) + [tokenizer.eod]
        assert tokenizer.detokenize(ids[:-1]) == text
    assert dataset.document_indices.tolist() == list(range(len(GOOD_TEXTS) + 1))

    # The output trains: GPT samples come out of it with the same tokenizer files.
    config = DataConfig(data_path=[str(tmp_path / "out" / "corpus_text_document")], split="1,0,0",
                        tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(tmp_path / "merges.txt"))
    train, valid, test = build_gpt_datasets(config, 8, 1, (20, None, None), tokenizer)
    assert len(train) == 20 and valid is None and test is None


@pytest.mark.distributed  # starts a process
def test_two_workers_write_identical_files(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    with open(corpus, "ab") as handle:  # enough lines for several worker chunks
        for index in range(300):
            handle.write(json.dumps({"text": f"the document number {index}"}).encode() + b"\n")
    assert run_tool(tmp_path, corpus, tmp_path / "one") == 0
    assert run_tool(tmp_path, corpus, tmp_path / "two", "--workers", "2") == 0
    for extension in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{extension}").read_bytes() == \
            (tmp_path / f"two_text_document{extension}").read_bytes()


def test_strict_mode_stops_and_leaves_no_output(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    assert run_tool(tmp_path, corpus, tmp_path / "strict", "--strict") == 1
    assert "line 2: invalid JSON" in capsys.readouterr().err
    assert not [name for name in os.listdir(tmp_path) if name.startswith("strict")]


def test_null_tokenizer_and_missing_input(tmp_path, capsys):
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text('{"text": "1 2 3"}\n{"text": "not ids"}\n{"text": "4 5"}\n',
                      encoding="utf-8")
    tool = load_tool("preprocess_data")
    assert tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "ids"),
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                      "--append-eod"]) == 0
    dataset = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert [dataset[i].tolist() for i in range(2)] == [[1, 2, 3, 10], [4, 5, 10]]
    assert "line 2: cannot tokenise 'text'" in capsys.readouterr().err
    assert tool.main(["--input", str(tmp_path / "absent.jsonl"), "--output-prefix", "x",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]) == 1
    assert "absent.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--input", str(corpus), "--output-prefix", "x", "--tokenizer-type",
                   "NullTokenizer", "--split-sentences"])


def test_gpt_sentencepiece_tokenizer_appends_the_models_eos_as_eod(tmp_path):
    import sentencepiece

    from megatron.training.tokenizer.sentencepiece_training import train_sentencepiece

    documents = [f"the cat {i} sat on the mat and the dog ran {i * 7}" for i in range(200)]
    model = train_sentencepiece(documents, str(tmp_path / "tok"), vocab_size=300)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in GOOD_TEXTS[:2]),
                      encoding="utf-8")
    assert load_tool("preprocess_data").main([
        "--input", str(corpus), "--output-prefix", str(tmp_path / "spm"),
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model,
        "--append-eod"]) == 0
    processor = sentencepiece.SentencePieceProcessor()
    processor.Load(model)
    dataset = IndexedDataset(str(tmp_path / "spm_text_document"))
    assert [dataset[i].tolist() for i in range(2)] == [
        processor.encode_as_ids(text) + [processor.eos_id()] for text in GOOD_TEXTS[:2]]


def test_int32_for_large_vocabularies(tmp_path):
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text('{"text": "70000 1"}\n', encoding="utf-8")
    assert load_tool("preprocess_data").main([
        "--input", str(corpus), "--output-prefix", str(tmp_path / "big"),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100000"]) == 0
    dataset = IndexedDataset(str(tmp_path / "big_text_document"))
    assert dataset.dtype == np.int32 and dataset[0].tolist() == [70000, 1]


def test_megatron_written_dataset_trains_with_gpt2_files(tmp_path):
    """A uint16 pair laid out field by field as Megatron writes it, read with GPT-2 files."""
    import struct

    tokenizer = GPT2BPETokenizer(*gpt2_files(tmp_path))
    documents = [tokenizer.tokenize(text) + [tokenizer.eod] for text in GOOD_TEXTS * 3]
    lengths = [len(d) for d in documents]
    pointers = [2 * sum(lengths[:i]) for i in range(len(lengths))]
    prefix = tmp_path / "megatron_text_document"
    (tmp_path / "megatron_text_document.bin").write_bytes(
        b"".join(struct.pack(f"<{len(d)}H", *d) for d in documents))
    (tmp_path / "megatron_text_document.idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(documents), len(documents) + 1)
        + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(documents) + 1}q", *range(len(documents) + 1)))
    config = DataConfig(data_path=[str(prefix)], split="1,0,0", tokenizer_type="GPT2BPETokenizer",
                        vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(tmp_path / "merges.txt"))
    train, _, _ = build_gpt_datasets(config, 16, 7, (None, None, None), tokenizer)
    stream = [token for document in documents for token in document]
    assert len(train) == -(-len(stream) // 16)  # one epoch: the windows starting in its tokens
    shuffled_stream = [token for d in train.document_index for token in documents[int(d)]]
    for index in range(len(train)):
        start = int(train.shuffle_index[index]) * 16
        assert train[index]["text"].tolist() == shuffled_stream[start:start + 17]
    first_epoch = [token for d in train.document_index[:len(documents)]
                   for token in documents[int(d)]]
    assert tokenizer.detokenize(first_epoch).count("<|endoftext|>") == len(documents)


def output_files(directory, prefix):
    return [name for name in os.listdir(directory) if name.startswith(prefix)]


def test_gzip_input_is_refused_with_the_fix(tmp_path, capsys):
    import gzip

    plain = tmp_path / "corpus.jsonl"
    write_corpus(plain, with_bad_lines=False)
    compressed = tmp_path / "corpus.jsonl.gz"
    compressed.write_bytes(gzip.compress(plain.read_bytes()))
    assert run_tool(tmp_path, compressed, tmp_path / "gz") == 1
    message = capsys.readouterr().err
    assert str(compressed) in message and "gzip-compressed" in message
    assert "decompress it first" in message and f"gunzip -k {compressed}" in message
    assert not output_files(tmp_path, "gz_")


@pytest.mark.parametrize("content,words", [
    (b"", "is empty"),
    (b"\n  \n\n", "is empty"),
    (b"plain text, not json\nmore text\n", "every one of the 2 lines"),
    (b"\xff\xfe\x00binary\n", "looks binary"),
    (b'{"body": "a"}\n{"body": "b"}\n', "--json-keys"),
    (b'{"text": ""}\n', "documents of"),
])
def test_input_without_documents_exits_non_zero_naming_the_file(tmp_path, capsys, content, words):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(content)
    assert run_tool(tmp_path, corpus, tmp_path / "none") == 1
    message = capsys.readouterr().err
    assert "error: no document to write" in message and str(corpus) in message and words in message
    assert not output_files(tmp_path, "none_")


def test_glob_input_is_read_in_sorted_order_into_one_output(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    texts = {"b.jsonl": ["second file"], "a.jsonl": ["first file", "still first"],
             "c.jsonl": ["third file"]}
    for name, documents in texts.items():
        (shards / name).write_text("".join(json.dumps({"text": text}) + "\n"
                                           for text in documents), encoding="utf-8")
    (shards / "d.jsonl").write_bytes(b"not json\n")  # a file with no document: only a warning
    assert run_tool(tmp_path, str(shards / "*.jsonl"), tmp_path / "all") == 0
    message = capsys.readouterr().err
    assert f"WARNING: no document from this input file: every one of the 1 lines of " \
           f"{shards / 'd.jsonl'}" in message
    assert "read 4 input files" in message

    tokenizer = GPT2BPETokenizer(*gpt2_files(tmp_path))
    dataset = IndexedDataset(str(tmp_path / "all_text_document"))
    in_order = texts["a.jsonl"] + texts["b.jsonl"] + texts["c.jsonl"]
    assert [dataset[i].tolist() for i in range(len(dataset))] == \
        [tokenizer.tokenize(text) + [tokenizer.eod] for text in in_order]

    # The same files listed one by one (as an unquoted glob expands) give the same output.
    listed = [str(shards / name) for name in ("a.jsonl", "b.jsonl", "c.jsonl")]
    assert run_tool(tmp_path, "unused", tmp_path / "listed", "--input", *listed) == 0
    for extension in (".bin", ".idx"):
        assert (tmp_path / f"all_text_document{extension}").read_bytes() == \
            (tmp_path / f"listed_text_document{extension}").read_bytes()


def test_glob_matching_nothing_names_the_pattern(tmp_path, capsys):
    pattern = str(tmp_path / "missing" / "*.jsonl")
    assert run_tool(tmp_path, pattern, tmp_path / "x") == 1
    assert f"--input pattern {pattern!r} matches no file" in capsys.readouterr().err


@pytest.mark.distributed  # starts a process
def test_megatron_lang_and_keep_sequential_samples_are_accepted(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, with_bad_lines=False)
    assert run_tool(tmp_path, corpus, tmp_path / "plain") == 0
    capsys.readouterr()
    assert run_tool(tmp_path, corpus, tmp_path / "flags", "--lang", "english",
                    "--keep-sequential-samples", "--workers", "2") == 0
    assert "--lang english is ignored" in capsys.readouterr().err
    for extension in (".bin", ".idx"):  # document order is kept either way
        assert (tmp_path / f"plain_text_document{extension}").read_bytes() == \
            (tmp_path / f"flags_text_document{extension}").read_bytes()
    with pytest.raises(SystemExit):
        load_tool("preprocess_data").main(["--help"])
    help_text = capsys.readouterr().out
    assert "--keep-sequential-samples" in help_text and "--lang" in help_text
