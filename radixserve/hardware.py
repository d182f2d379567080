"""What this machine and the installed torch offer, read without importing torch where it can
be: the CPU's bfloat16 feature, whether the torch build has CUDA, which weight format a model
runs in."""

from __future__ import annotations

import os
from typing import Any


def cpu_bf16_feature(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU feature that makes bfloat16 matmuls fast here ("AMX", "AVX-512 BF16"), or None.
    Without one, torch emulates bfloat16 and float32 is faster."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return None


def _torch_version_fields() -> dict[str, str | None]:
    """``torch/version.py``'s fields, read as text: importing torch takes 1-2 s, which a CPU
    build (whose ``cuda`` and ``hip`` are None) never needs to know it has no GPU."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    fields: dict[str, str | None] = {}
    if spec is None or not spec.submodule_search_locations:
        return fields
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            for line in f:
                name, sep, value = line.partition("=")
                name = name.split(":")[0].strip()
                if sep and name in ("__version__", "cuda", "hip"):
                    value = value.strip()
                    fields[name] = None if value == "None" else value.strip("'\"")
    except OSError:
        pass
    return fields


def torch_build_has_cuda() -> bool:
    """Whether the installed torch is a CUDA (or ROCm) build; True when that cannot be read."""
    fields = _torch_version_fields()
    return "cuda" not in fields or fields.get("cuda") is not None or fields.get("hip") is not None


def torch_build_version() -> str:
    return _torch_version_fields().get("__version__") or "unknown"


def _torch_cuda() -> Any:
    import torch

    return torch.cuda


def resolve_quantization(mode: str, gguf_path: str | None, on_cpu: bool, tp_size: int) -> str:
    """``mode`` with ``auto`` resolved: ``gguf`` for a model from ``gguf_path`` (None: not a
    GGUF; see :func:`checkpoint.gguf_index.gguf_source`) that has tensors of a type it serves,
    on a CPU, one rank; else ``none``."""
    if mode != "auto":
        return mode
    from radixserve.checkpoint.gguf_index import served_tensor_count

    usable = gguf_path is not None and on_cpu and tp_size == 1
    return "gguf" if usable and served_tensor_count(gguf_path) else "none"


def check_quantization_device(quantization: str, on_cpu: bool) -> None:
    """A ValueError for a resolved ``quantization`` whose weights this device cannot multiply:
    every method but ``none`` runs its weights through the CPU kernels (``QuantMethod.on_gpu``
    in quantization/base.py says the same, above this module)."""
    if not on_cpu and quantization != "none":
        raise ValueError(
            f"quantization {quantization} multiplies its weights with the CPU kernels; on a GPU "
            "serve the checkpoint's float weights (quantization none or auto) or use --device cpu"
        )
