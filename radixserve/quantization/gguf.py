"""``--quantization gguf``: a GGUF file's quantized tensors served as they are stored.

Each matmul weight whose GGUF tensor is of a type registered in registry.py (Q4_0 / Q4_1 as an
:class:`~radixserve.quantization.int4.Int4Weight`, Q4_0's ``m`` being ``-8 d``; Q8_0 as an
:class:`~radixserve.quantization.int8.Int8Weight` with a scale per 32; Q4_K / Q5_K / Q6_K as a
:class:`~radixserve.quantization.kquant.KQuantWeight`) takes that tensor's blocks, read from the
file into the model before any float weight is made (the loader builds the model without
weights and reads the rest afterwards, model/gguf_weights.py).  The token embedding takes its
blocks too: a lookup dequantizes the rows it reads.

Before a layer takes its blocks, a few of its rows are dequantized by the weight class and by
the ``gguf`` package's own reader and compared bit for bit: a reader that disagrees with the
format keeps the layer's float weight (the load says so) rather than serving garbage.  Weights
and products are then those of a float32 run of the same file; only the order of the sums
differs.

``auto`` chooses it for a GGUF model with tensors of those types on a CPU, one rank: int8 and
int4 of a float checkpoint round every weight, the GGUF's blocks none.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
from torch import nn

from radixserve import cpu_ext
from radixserve.checkpoint.gguf_index import GGUFTensor, read_gguf_index
from radixserve.checkpoint.gguf_tensors import GGUFNames, ggml_type, read_raw, rope_order
from radixserve.quantization.base import QuantMethod
from radixserve.quantization.registry import get_gguf_type, gguf_types
from radixserve.quantization.weights import QuantizedWeight

log = logging.getLogger("radixserve")


class GGUFMethod(QuantMethod):
    name = "gguf"
    gguf_types = gguf_types()
    auto_rank = 1
    auto_cpu_only = True
    one_rank = True
    int8_activations = True

    def kernels(self) -> tuple[str, ...]:
        found: dict[str, None] = {}
        for kind in self.gguf_types:
            found.update(dict.fromkeys(get_gguf_type(kind).weight.kernels))
        return tuple(found)

    def apply(self, model: nn.Module, modules: list[tuple[str, nn.Module]], head: nn.Module | None,
              gguf_path: str | None) -> None:
        if gguf_path is None:
            raise ValueError("quantization gguf serves the blocks of a .gguf model; this model is "
                             "not one (int8 or int4 quantize a float checkpoint)")
        embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
        if embedding is not None and all(m is not embedding for _, m in modules):
            modules = [*modules, ("model.embed_tokens", embedding)]  # untied: its own table
        kinds, before, after = serve_gguf_blocks(model, gguf_path, modules)
        log.info("weights served as the GGUF's blocks: %.0f MB as floats -> %.0f MB; %s",
                 before / 2**20, after / 2**20,
                 ", ".join(f"{count} layer(s) {what}" for what, count in sorted(kinds.items())))


def block_weight(raw: np.ndarray, tensor: GGUFTensor,
                 dtype: torch.dtype) -> QuantizedWeight | None:
    """The tensor's stored bytes (``raw``, uint8 [rows, bytes]) as its weight class holds them,
    or None for a type not served as stored."""
    kind = get_gguf_type(tensor.kind)
    if kind is None or len(tensor.shape) != 2:
        return None
    k, rows = tensor.shape
    blocks = k // kind.block_weights
    return kind.read(torch.from_numpy(raw).view(rows, blocks, kind.block_bytes), dtype)


def dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The float weight, through the C++ kernel where it loads (torch's ops would be much of the
    load's time)."""
    if cpu_ext.load() is None:
        return weight.dequantized(dtype)
    out = torch.empty(weight.shape, dtype=dtype)
    weight.dequantize_into(out)
    return out


def _agrees(weight: QuantizedWeight, raw: np.ndarray, tensor: GGUFTensor) -> bool:
    """Whether the weight's first, middle and last rows dequantize as the ``gguf`` package
    dequantizes the stored bytes of those rows."""
    from gguf.quants import dequantize

    rows = raw.shape[0]
    probe = sorted({0, rows // 2, rows - 1})
    want = torch.from_numpy(dequantize(raw[probe], ggml_type(tensor.kind)))
    return torch.equal(weight.rows(torch.tensor(probe)).float(), want.float())


def _parts(name: str, module: nn.Module) -> list[str]:
    """The Hugging Face name of each part of the module's weight, in row order."""
    shards = getattr(module, "shard_offsets", None)
    if not shards:
        return [f"{name}.weight"]
    parent = name.rsplit(".", 1)[0]
    return [f"{parent}.{shard}_proj.weight" for shard in shards]


def _layer_blocks(name: str, module: nn.Module, f: object,
                  names: GGUFNames) -> tuple[QuantizedWeight | None, str]:
    """The GGUF's blocks for one layer's weight (its parts joined in row order) and what it
    got, or None and why it keeps a float weight."""
    weight = module.weight
    parts, label = [], ""
    for hf_name in _parts(name, module):
        tensor = names.tensor(hf_name)
        kind = get_gguf_type(tensor.kind) if tensor is not None else None
        if kind is None or len(tensor.shape) != 2:
            return None, f"float: {tensor.kind if tensor is not None else 'no GGUF tensor'}"
        raw = read_raw(f, tensor)
        blocks = block_weight(raw, tensor, weight.dtype)
        if not _agrees(blocks, raw, tensor):
            log.warning("GGUF tensor %s: its %s blocks do not read as the gguf package reads "
                        "them; the layer keeps a float weight", tensor.name, tensor.kind)
            return None, "float: blocks not read as the gguf package reads them"
        heads = names.heads_of(hf_name)
        if heads:
            blocks = blocks.take_rows(torch.from_numpy(rope_order(blocks.shape[0], heads)))
        parts.append(blocks)
        label = label or kind.label
    if len({type(p) for p in parts}) != 1:  # a K-quant weight joins parts of its kinds
        return None, "float: parts of mixed types"
    joined = parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)
    if tuple(joined.shape) != tuple(weight.shape):
        raise ValueError(f"GGUF tensors of {name}: shape {tuple(joined.shape)}, the model's "
                         f"{tuple(weight.shape)}")
    return joined, label


def serve_gguf_blocks(model: nn.Module, gguf_path: str,
                      modules: list[tuple[str, nn.Module]]) -> tuple[Counter, int, int]:
    """Replace, in place, the weight of each ``(name, module)`` (a float Parameter, or one on the
    meta device that the loader fills later) by the GGUF's blocks where its type is served.
    Returns the layers counted by what they got, and the weights' bytes as floats and after."""
    config = model.config
    names = GGUFNames(read_gguf_index(gguf_path), config.num_layers, config.num_heads,
                      config.num_kv_heads)
    kinds: Counter = Counter()
    before = after = 0
    with open(gguf_path, "rb") as f:
        for name, module in modules:
            quantized, kind = _layer_blocks(name, module, f, names)
            kinds[kind] += 1
            float_bytes = module.weight.numel() * module.weight.element_size()
            before += float_bytes
            if quantized is None:
                after += float_bytes
                continue
            after += quantized.nbytes
            del module.weight
            module.weight = quantized
    return kinds, before, after
