"""``--quantization gguf``: a GGUF file's quantized tensors served as they are stored.

The loader builds every model from float weights (a GGUF is dequantized once into the cache
folder, model/gguf_convert.py).  Here each matmul weight whose GGUF tensor is of a type
registered in registry.py (Q4_0 / Q4_1 as an :class:`~radixserve.quantization.int4.Int4Weight`,
Q4_0's ``m`` being ``-8 d``; Q8_0 as an :class:`~radixserve.quantization.int8.Int8Weight` with a
scale per 32) takes that tensor's blocks instead: the same weights float32 computes with in a
quarter to a sixth of the bytes.  Before a layer takes them its blocks are dequantized and
compared with the float weight the converter wrote, bit for bit: the model computes with the
same weights as in float32 (only the order of the sums differs), and a name mapped wrongly or a
row order not undone keeps the float weight instead of serving garbage.

Names: the model's parameter names are Hugging Face's (a merged q/k/v or gate/up layer has one
per part), mapped to GGUF's by the ``gguf`` package's own table.  llama.cpp stores a Llama's q and
k rows interleaved for its RoPE; transformers undoes that on load, and so do the rows here (both
orders are tried: other architectures are stored as they are).

``auto`` chooses it for a GGUF model with tensors of those types on a CPU, one rank: int8 and
int4 of a float checkpoint round every weight, the GGUF's blocks none.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from radixserve import cpu_ext
from radixserve.checkpoint.gguf_index import GGUFTensor, read_gguf_index
from radixserve.quantization.base import GGUFType, QuantMethod
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
        kinds, before, after = serve_gguf_blocks(model, gguf_path, modules)
        log.info("weights served as the GGUF's blocks: %.0f MB -> %.0f MB; %s", before / 2**20,
                 after / 2**20,
                 ", ".join(f"{count} layer(s) {what}" for what, count in sorted(kinds.items())))


def _block_weight(file: np.memmap, tensor: GGUFTensor,
                  dtype: torch.dtype) -> tuple[QuantizedWeight, GGUFType] | None:
    """The GGUF tensor's blocks as a quantized weight (rows: the tensor's rows) and its type's
    reader, or None for a type not served."""
    kind = get_gguf_type(tensor.kind)
    if kind is None or len(tensor.shape) != 2:
        return None
    k, rows = tensor.shape
    blocks, size = k // kind.block_weights, kind.block_bytes
    raw = file[tensor.offset:tensor.offset + rows * blocks * size]
    if k % kind.block_weights or len(raw) != rows * blocks * size:
        raise ValueError(f"GGUF tensor {tensor.name}: {tensor.kind} {tensor.shape} does not fit "
                         "the file")
    return kind.read(torch.from_numpy(np.array(raw).reshape(rows, blocks, size)), dtype), kind


def _row_orders(rows: int, heads: int | None) -> Iterator[torch.Tensor | None]:
    """The stored order (None), then, for q / k, llama.cpp's RoPE interleave undone."""
    yield None
    if heads and rows % (2 * heads) == 0:
        yield torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The float weight, through the C++ kernel where it loads (torch's ops would be much of the
    load's time)."""
    if cpu_ext.load() is None:
        return weight.dequantized(dtype)
    out = torch.empty(weight.shape, dtype=dtype)
    weight.dequantize_into(out)
    return out


def _matching(weight: QuantizedWeight, target: torch.Tensor,
              heads: int | None) -> QuantizedWeight | None:
    """``weight`` (or its rows reordered) if it dequantizes to ``target`` exactly, else None."""
    if tuple(weight.shape) != tuple(target.shape):
        return None
    probe = torch.tensor([0, target.shape[0] - 1])
    for order in _row_orders(target.shape[0], heads):
        # two rows first: a wrong row order fails there, without a whole dequantization
        rows = weight.rows(probe if order is None else order[probe]).to(target.dtype)
        if not torch.equal(rows, target[probe]):
            continue
        candidate = weight if order is None else weight.take_rows(order)
        if torch.equal(_dequantized(candidate, target.dtype), target):
            return candidate
    return None


def _parts(name: str, module: nn.Module) -> list[tuple[str, str | None]]:
    """``(checkpoint name, shard)`` of each part of the module's weight, in row order."""
    shards = getattr(module, "shard_offsets", None)
    if not shards:
        return [(f"{name}.weight", None)]
    parent = name.rsplit(".", 1)[0]
    return [(f"{parent}.{shard}_proj.weight", shard) for shard in shards]


def _layer_blocks(name: str, module: nn.Module, tensors: dict[str, GGUFTensor], file: np.memmap,
                  names: object, heads: dict[str, int]) -> tuple[QuantizedWeight | None, str]:
    """The GGUF's blocks for one layer's weight (its parts joined in row order) and what it
    got, or None and why it keeps its float weight."""
    weight = module.weight.detach()
    parts, label = [], ""
    for hf_name, shard in _parts(name, module):
        gguf_name = None if names is None else names.get_name(hf_name, try_suffixes=(".weight",))
        if gguf_name == "output.weight" and gguf_name not in tensors:
            gguf_name = "token_embd.weight"  # a tied LM head is the embedding table
        tensor = tensors.get(gguf_name)
        read = _block_weight(file, tensor, weight.dtype) if tensor is not None else None
        if read is None:
            return None, f"float: {tensor.kind if tensor is not None else 'no GGUF tensor'}"
        blocks, label = read[0], label or read[1].label
        start, size = module.shard_offsets[shard] if shard else (0, weight.shape[0])
        blocks = _matching(blocks, weight[start:start + size], heads.get(shard or ""))
        if blocks is None:
            return None, "float: blocks differ from the converted weight"
        parts.append(blocks)
    if len({type(p) for p in parts}) != 1:
        return None, "float: parts of mixed types"
    return (parts[0] if len(parts) == 1 else type(parts[0]).cat(parts)), label


def serve_gguf_blocks(model: nn.Module, gguf_path: str,
                      modules: list[tuple[str, nn.Module]]) -> tuple[Counter, int, int]:
    """Replace, in place, the weight of each ``(name, module)`` by the GGUF's blocks where they
    dequantize to it exactly.  Returns the layers counted by what they got, and the weights'
    bytes before and after."""
    import gguf

    index = read_gguf_index(gguf_path)
    file = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(index.architecture)
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_layers) if arch is not None else None
    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    kinds: Counter = Counter()
    before = after = 0
    for name, module in modules:
        quantized, kind = _layer_blocks(name, module, index.tensors, file, names, heads)
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
