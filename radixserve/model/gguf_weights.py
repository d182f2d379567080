"""A model's float weights read straight from its GGUF file, tensor by tensor: no float copy on
disk.  ``--quantization gguf`` takes the blocks of the types it serves as stored first
(quantization/gguf.py); this reads the rest (norms, biases, a layer of a type not served, every
weight under another quantization or on a GPU), each dequantized to the model's dtype.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np
import torch
from torch import nn

from radixserve.checkpoint.gguf_index import GGUFIndex, GGUFTensor
from radixserve.checkpoint.gguf_tensors import GGUFNames, ggml_type, read_raw, rope_order
from radixserve.quantization.gguf import block_weight, dequantized

log = logging.getLogger("radixserve")
_STORED_FLOATS = ("F32", "F16", "BF16")


def float_tensor(f: BinaryIO, tensor: GGUFTensor, dtype: torch.dtype,
                 heads: int | None) -> torch.Tensor:
    """The tensor as floats of ``dtype`` in Hugging Face's shape and row order: F32, F16 and
    BF16 as stored; a type served as stored (quantization/registry.py) through its weight
    class's kernel; any other through the ``gguf`` package's dequantization."""
    from gguf.quants import dequantize

    raw = read_raw(f, tensor)
    shape = tuple(reversed(tensor.shape))
    if tensor.kind == "F32":
        out = torch.from_numpy(raw.view(np.float32))
    elif tensor.kind == "F16":
        out = torch.from_numpy(raw.view(np.float16))
    elif tensor.kind == "BF16":
        out = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    else:
        blocks = block_weight(raw, tensor, dtype) if len(shape) == 2 else None
        if blocks is not None:
            out = dequantized(blocks, dtype)
        else:
            out = torch.from_numpy(dequantize(raw, ggml_type(tensor.kind)))
    out = out.reshape(shape)
    if heads:
        out = out[torch.from_numpy(rope_order(shape[0], heads))]
    return out.to(dtype)


def _wanted(model: nn.Module) -> list[str]:
    """The Hugging Face names of the model's weights still to read: its parameters, a merged
    layer's as one per part."""
    wanted = []
    for name, _ in model.named_parameters():
        prefix, kind = name.rsplit(".", 1)
        shards = getattr(model.get_submodule(prefix), "shard_offsets", None)
        if shards:
            parent = prefix.rsplit(".", 1)[0]
            wanted.extend(f"{parent}.{shard}_proj.{kind}" for shard in shards)
        else:
            wanted.append(name)
    return wanted


def iter_gguf_weights(model: nn.Module, path: str, index: GGUFIndex,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, float tensor)`` of each of the model's parameters (a layer whose
    weight quantization replaced has none), read from the GGUF ``path``."""
    config = model.config
    names = GGUFNames(index, config.num_layers, config.num_heads, config.num_kv_heads)
    kinds: Counter = Counter()
    with open(path, "rb") as f:
        for hf_name in _wanted(model):
            tensor = names.tensor(hf_name)
            if tensor is None:
                raise ValueError(f"{path}: no GGUF tensor for the model's weight {hf_name}")
            kinds[tensor.kind] += 1
            yield hf_name, float_tensor(f, tensor, dtype, names.heads_of(hf_name))
    converted = sorted(k for k in kinds if k not in _STORED_FLOATS)
    if converted:
        log.info("GGUF tensors dequantized to %s at load: %s", str(dtype).removeprefix("torch."),
                 ", ".join(f"{kinds[k]} {k}" for k in converted))
