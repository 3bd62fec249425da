"""``--tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME_OR_DIRECTORY``: any tokenizer
``transformers.AutoTokenizer`` loads, with Megatron-LM's semantics.

``tokenize(text)`` is the tokenizer's ``input_ids`` for the text, special tokens included (a Llama 3
tokenizer puts its ``<|begin_of_text|>`` first), ``detokenize`` is its ``decode``, the vocabulary size
is ``len(tokenizer)`` (added tokens included) and the end-of-document id is its eos token.

``NAME_OR_DIRECTORY`` is a local directory (what ``save_pretrained`` writes) or a Hugging Face hub
name; a name is looked up in the local cache first and only then downloaded, and a failure to do
either says how to provide the tokenizer offline (``HF_HUB_OFFLINE=1`` skips the download attempt,
which without internet takes a minute of retries).
"""

from __future__ import annotations

import os
from typing import Any


def _load(name_or_path: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("--tokenizer-type HuggingFaceTokenizer needs the transformers package: "
                          "pip install transformers") from None
    if os.path.isdir(name_or_path):
        try:
            return transformers.AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:
            raise ValueError(f"--tokenizer-model {name_or_path} is a directory but not a Hugging "
                             f"Face tokenizer ({error}); pass the directory that "
                             f"tokenizer.save_pretrained() wrote") from None
    try:  # a hub name already in the local cache
        return transformers.AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    reason = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            return transformers.AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:
            reason = f"downloading it failed (HF_HUB_OFFLINE=1 skips the attempt): {error}"
    raise ValueError(
        f"--tokenizer-model {name_or_path} is neither a local tokenizer directory nor a Hugging "
        f"Face model in the local cache, and {reason}. Fix: on a machine with internet access "
        f"run `python -c \"import transformers; transformers.AutoTokenizer.from_pretrained("
        f"'{name_or_path}').save_pretrained('DIR')\"` (or `huggingface-cli download "
        f"{name_or_path}`), copy DIR here and pass --tokenizer-model DIR")


class HuggingFaceTokenizer:
    """A ``transformers`` tokenizer behind this project's tokenizer interface (``vocab_size``,
    ``eod``, ``bos``, ``pad``, ``vocab``, ``tokenize``, ``detokenize``)."""

    def __init__(self, name_or_path: str):
        if not name_or_path:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a "
                             "tokenizer directory or a Hugging Face model name)")
        self.name_or_path = name_or_path
        self.tokenizer = _load(name_or_path)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"the Hugging Face tokenizer {name_or_path} has no eos token, which "
                             f"is needed as the end-of-document id; set tokenizer.eos_token and "
                             f"save it again")
        self._vocab = dict(self.tokenizer.get_vocab())

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (FIM looks its special tokens up here)."""
        return self._vocab

    @property
    def eod(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def bos(self):
        return self.tokenizer.bos_token_id

    @property
    def pad(self):
        return self.tokenizer.pad_token_id

    def tokenize(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text``, with the special tokens it adds (Megatron's
        ``tokenizer(text).input_ids``)."""
        return list(self.tokenizer(text, verbose=False)["input_ids"])

    def detokenize(self, token_ids) -> str:
        return self.tokenizer.decode([int(index) for index in token_ids])
