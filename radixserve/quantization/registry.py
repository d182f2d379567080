"""The weight formats of ``--quantization`` by name, and the GGUF tensor types served as stored,
each imported when first asked for (as model/'s architectures are).

A method's entry here is its CLI name (the names plus ``auto`` are config.QUANTIZATIONS); a GGUF
tensor type's entry is the :class:`~radixserve.quantization.base.GGUFType` that reads its blocks
(served by ``--quantization gguf``; checkpoint/gguf_index.py's SERVED_TYPES lists the same, for
hardware.resolve_quantization, which sits below this package).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.quantization.base import GGUFType, QuantMethod

_METHODS: dict[str, str] = {
    "none": "radixserve.quantization.none:FloatMethod",
    "int8": "radixserve.quantization.int8:Int8Method",
    "int4": "radixserve.quantization.int4:Int4Method",
    "gguf": "radixserve.quantization.gguf:GGUFMethod",
}

_GGUF_TYPES: dict[str, str] = {
    "Q4_0": "radixserve.quantization.int4:Q4_0",
    "Q4_1": "radixserve.quantization.int4:Q4_1",
    "Q8_0": "radixserve.quantization.int8:Q8_0",
    "Q4_K": "radixserve.quantization.kquant:Q4_K",
    "Q5_K": "radixserve.quantization.kquant:Q5_K",
    "Q6_K": "radixserve.quantization.kquant:Q6_K",
}


def _load(target: str) -> object:
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def names() -> tuple[str, ...]:
    """The registered methods' names (``auto`` aside), without importing them."""
    return tuple(_METHODS)


@functools.cache
def get_method(name: str) -> QuantMethod:
    """The method registered as ``name``; a ValueError naming the known ones for another."""
    if name not in _METHODS:
        raise ValueError(f"quantization must be one of {list(_METHODS)}, got {name!r}")
    return _load(_METHODS[name])()


def methods() -> list[QuantMethod]:
    return [get_method(name) for name in _METHODS]


def gguf_types() -> tuple[str, ...]:
    """The GGUF tensor types served as stored, without importing their readers."""
    return tuple(_GGUF_TYPES)


def get_gguf_type(kind: str) -> GGUFType | None:
    """The reader of a GGUF tensor type, or None for a type not served as stored."""
    return _load(_GGUF_TYPES[kind]) if kind in _GGUF_TYPES else None


def resolve(name: str, gguf_source: str | None, on_cpu: bool, tp_size: int) -> str:
    """``name`` with ``auto`` resolved: the highest-ranked method whose ``auto_rank`` is set that
    may run here (``auto_cpu_only``: on a CPU; ``one_rank``: tp_size 1) and, for one that serves
    GGUF tensor types, whose model is the GGUF ``gguf_source`` (None: not a GGUF) with tensors of
    one of them.  Today: ``gguf`` for such a GGUF on a CPU, one rank; else ``none`` (the rule
    of hardware.resolve_quantization)."""
    if name != "auto":
        return name
    kinds: set[str] | None = None
    ranked = sorted((m for m in methods() if m.auto_rank is not None), key=lambda m: -m.auto_rank)
    for method in ranked:
        if (method.auto_cpu_only and not on_cpu) or (method.one_rank and tp_size != 1):
            continue
        if method.gguf_types:
            if gguf_source is None:
                continue
            if kinds is None:
                kinds = _tensor_kinds(gguf_source)
            if not kinds & set(method.gguf_types):
                continue
        return method.name
    raise ValueError("quantization auto: no registered method applies")


def _tensor_kinds(gguf_path: str) -> set[str]:
    """The types of the file's tensors (a header read)."""
    from radixserve.checkpoint.gguf_index import read_gguf_index

    return {tensor.kind for tensor in read_gguf_index(gguf_path).tensors.values()}
