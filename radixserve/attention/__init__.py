"""Attention backends, chosen by ``--attention-backend`` and imported lazily."""

from __future__ import annotations

import importlib

from radixserve.attention.base import AttentionBackend, AttentionLayerInfo

_REGISTRY: dict[str, str] = {
    "torch": "radixserve.attention.torch_backend:TorchAttentionBackend",
    "triton": "radixserve.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_backends()}"
        )
    module_name, cls_name = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise ValueError(f"the {name} attention backend needs triton, which a CPU install leaves "
                         "out: pip install 'radixserve[gpu]'") from e
    return getattr(module, cls_name)()


__all__ = ["AttentionBackend", "AttentionLayerInfo", "available_backends", "create_backend"]
