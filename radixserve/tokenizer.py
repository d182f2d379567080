"""Tokenizer loading for a model folder or a GGUF file."""

from __future__ import annotations

import os
from typing import Any

from radixserve.checkpoint.records import read_record, record_path, write_record

# The class transformers' own tokenizer.json loader has (v5); where AutoTokenizer resolved a
# folder to it once, later loads call it directly.
_BACKEND_CLASS = "TokenizersBackend"
_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a model folder, or from the metadata of a .gguf file.

    ``AutoTokenizer`` resolves the class from the model's config, which imports transformers'
    model code and torch: seconds of every start on a small CPU, more than the tokenizer
    itself takes.  The class it resolved is kept in the cache folder (keyed by the folder's
    tokenizer and config files and the transformers version); where that was transformers'
    generic tokenizer.json class, later loads call it directly, with the same result."""
    if path.endswith(".gguf") and os.path.isfile(path):
        from transformers import AutoTokenizer

        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    record = _class_record(path)
    if record is not None and read_record(record) == {"class": _BACKEND_CLASS}:
        import transformers

        backend = getattr(transformers, _BACKEND_CLASS, None)
        if backend is not None:
            return backend.from_pretrained(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if record is not None:
        write_record(record, {"class": type(tokenizer).__name__})
    return tokenizer


def _class_record(path: str) -> str | None:
    """Where the class AutoTokenizer resolves ``path`` to is recorded, or None (not a folder)."""
    if not os.path.isdir(path):
        return None
    keys = []
    for name in _TOKENIZER_FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                keys.append(name.encode() + f.read())
        except OSError:
            keys.append(name.encode())
    return record_path("tokenizer-classes", *keys)


class DeferredTokenizer:
    """A tokenizer that loads when first asked for (``get``): for a process that needs one only
    for some requests (the scheduler's grammars)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer: Any = None

    def get(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


class TokenDecoder:
    """Token ids to text by the ``tokenizers`` library alone: what a fast Hugging Face
    tokenizer's ``decode`` runs when it cleans up no spaces.  For the processes that only
    decode (the detokenizer, the scheduler's stop strings): importing transformers takes
    seconds of every start, ``tokenizers`` milliseconds."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_decoder(path: str) -> Any:
    """A :class:`TokenDecoder` for a folder with a ``tokenizer.json`` whose tokenizer cleans up
    no spaces; otherwise the full tokenizer of :func:`load_tokenizer`."""
    import json

    spec = os.path.join(path, "tokenizer.json")
    config_path = os.path.join(path, "tokenizer_config.json")
    if os.path.isdir(path) and os.path.isfile(spec):
        try:
            with open(config_path) as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = None
        if isinstance(config, dict) and not config.get("clean_up_tokenization_spaces", False):
            from tokenizers import Tokenizer

            return TokenDecoder(Tokenizer.from_file(spec))
    return load_tokenizer(path)
