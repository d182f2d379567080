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
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls()


__all__ = ["AttentionBackend", "AttentionLayerInfo", "available_backends", "create_backend"]
