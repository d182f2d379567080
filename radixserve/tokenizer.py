"""Tokenizer loading for a model folder or a GGUF file."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a model folder, or from the metadata of a .gguf file."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf") and os.path.isfile(path):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(path)


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
