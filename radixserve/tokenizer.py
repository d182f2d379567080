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
