"""The radix tree's namespaces: a request's cache salt and its LoRA adapter, in one string.

Prefixes are shared only inside one namespace.  The base model's requests use their salt as
it is (``""`` without one); an adapter's requests use ``"\\0lora:" + key + "\\0" + salt``, where
``key`` (``name@digest``, ``lora/adapter.py``) changes when the adapter's weights do, so two
adapters, or an adapter and the base model, never read each other's KV.
"""

from __future__ import annotations

_LORA = "\0lora:"


def cache_namespace(salt: str, lora_key: str | None = None) -> str:
    return salt if lora_key is None else f"{_LORA}{lora_key}\0{salt}"


def split_namespace(namespace: str) -> tuple[str, str | None]:
    """``(salt, adapter name)`` of a namespace (the name None for the base model)."""
    if not namespace.startswith(_LORA):
        return namespace, None
    key, _, salt = namespace[len(_LORA):].partition("\0")
    return salt, key.rpartition("@")[0] or key
