"""A GGUF file's tensors as the model names and reads them: the ``gguf`` package's types, the
map from Hugging Face's parameter names to the file's, and each tensor's bytes.

llama.cpp stores a Llama's q and k rows interleaved for its RoPE (:func:`rope_order` undoes it,
as transformers does on load); Qwen2 and Qwen3 are stored as they are.  A tensor is read with
plain file reads into memory of its own (not a memory map, whose pages would count once more in
the process's resident memory for as long as the map lives).
"""

from __future__ import annotations

from typing import Any, BinaryIO

import numpy as np

from radixserve.checkpoint.gguf_index import GGUFIndex, GGUFTensor


def ggml_type(kind: str) -> Any:
    """The ``gguf`` package's type of a tensor kind as the index names it ("Q4_K", or "type 16"
    for one the index does not name), or None for a number unknown to the package too."""
    import gguf

    try:
        if kind.startswith("type "):
            return gguf.GGMLQuantizationType(int(kind[5:]))
        return gguf.GGMLQuantizationType[kind]
    except (KeyError, ValueError):
        return None


def tensor_bytes(tensor: GGUFTensor) -> int:
    """The bytes the tensor's data takes in the file."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type(tensor.kind)]
    count = 1
    for dim in tensor.shape:
        count *= dim
    return count // block * block_bytes


def read_raw(f: BinaryIO, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's stored bytes, uint8 ``[rows, bytes per row]`` (rows: all of its dimensions
    but GGUF's first, the one along a row)."""
    size = tensor_bytes(tensor)
    out = np.empty(size, dtype=np.uint8)
    f.seek(tensor.offset)
    if f.readinto(memoryview(out)) != size:
        raise ValueError(f"{f.name}: tensor {tensor.name} ends past the end of the file")
    rows = 1
    for dim in tensor.shape[1:]:
        rows *= dim
    return out.reshape(rows, size // max(rows, 1))


def rope_order(rows: int, heads: int) -> np.ndarray:
    """The stored rows in Hugging Face's order: ``stored[order]`` undoes llama.cpp's interleave
    of each head's two RoPE halves."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


class GGUFNames:
    """Hugging Face parameter names to the file's tensors, and the rows to reorder."""

    def __init__(self, index: GGUFIndex, num_layers: int, num_heads: int,
                 num_kv_heads: int) -> None:
        import gguf

        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[index.architecture]
        self.index = index
        self.names = gguf.get_tensor_name_map(arch, num_layers)
        # q / k rows interleaved: llama.cpp's converter does it for the llama architecture only
        self.heads = ({"q_proj": num_heads, "k_proj": num_kv_heads}
                      if index.architecture == "llama" else {})

    def tensor(self, hf_name: str) -> GGUFTensor | None:
        """The file's tensor of a Hugging Face weight or bias, or None."""
        gguf_name = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name == "output.weight" and gguf_name not in self.index.tensors:
            gguf_name = "token_embd.weight"  # a tied LM head is the embedding table
        return self.index.tensors.get(gguf_name)

    def heads_of(self, hf_name: str) -> int | None:
        """The heads whose rows llama.cpp interleaved in this weight, or None."""
        parts = hf_name.rsplit(".", 2)
        return self.heads.get(parts[-2]) if len(parts) == 3 and parts[-1] == "weight" else None
