"""Model definitions, keyed by the HF ``architectures[0]`` string and imported lazily.

All supported architectures share one decoder (:mod:`radixserve.model.decoder`).  Sliding-window
attention (Mistral, Qwen2 with ``use_sliding_window``) is not applied: results match the
reference only while contexts fit in the window.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.model.decoder import CausalLM

_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "radixserve.model.architectures:LlamaForCausalLM",
    "MistralForCausalLM": "radixserve.model.architectures:MistralForCausalLM",
    "Qwen2ForCausalLM": "radixserve.model.architectures:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "radixserve.model.architectures:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The model class for an HF architecture name; a clear error for unsupported ones."""
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {supported_architectures()}"
        )
    module_name, cls_name = _REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


__all__ = ["get_model_class", "supported_architectures"]
