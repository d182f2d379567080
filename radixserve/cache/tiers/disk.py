"""The disk tier: KV blocks in files, content addressed, that outlive the server.

A block is ``block_tokens`` consecutive tokens at a fixed position of a sequence
(``[i * block_tokens, (i + 1) * block_tokens)``).  Its name chains the names before it:
``h_i = blake2b(h_{i-1} || tokens of block i)``, with ``h_{-1}`` the store's identity and the
cache namespace; so a name stands for the whole prefix up to the end of its block, and a
server started on the same folder finds yesterday's prefixes by hashing today's prompts.

Identity: the model (path, config, weight files' sizes and times), the KV dtype and layout,
and the block size.  Its hash names a sub-folder; a folder of another identity is never read
(a line in the log says it was ignored), and every file repeats the identity in its header.

File: a header (magic, identity, block name, payload size, blake2b digest of the payload)
and the payload, K and V of every layer for the block's tokens.  A file whose header,
size or digest does not match is reported, deleted and never loaded.  Files are written to
a temporary name and renamed, so a crash leaves no half file under a block name.

All file I/O runs on one worker thread (writes and reads keep their order: a load queued
after a write of the same block finds the file).  The index (which blocks exist, in LRU
order, and the bytes they take) is the scheduler's, touched only on its thread.  Blocks of a
prefix are touched last-first, so that the LRU end holds a prefix's *last* blocks: evicting
a first block would orphan every block after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"RSKV1\0"
_HEADER = struct.Struct("<6s16s16sQ16s")  # magic, identity, block name, payload bytes, digest
SUFFIX = ".kv"


def identity_hash(identity: dict[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).digest()


def block_names(tokens: np.ndarray, block_tokens: int, seed: bytes, start: int = 0,
                previous: bytes | None = None) -> list[bytes]:
    """Names of the full blocks ``start, start + 1, ...`` of ``tokens`` (int64, from
    position 0); ``previous`` is the name of block ``start - 1`` (``seed`` for block 0)."""
    out: list[bytes] = []
    h = seed if previous is None else previous
    data = np.ascontiguousarray(tokens, dtype=np.int64)
    for i in range(start, len(data) // block_tokens):
        h = hashlib.blake2b(h + data[i * block_tokens : (i + 1) * block_tokens].tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


class LoadResult(NamedTuple):
    blocks: list[torch.Tensor]  # the leading blocks that loaded, in order
    bad: list[bytes]  # blocks whose file was missing, truncated or corrupted


class DiskStore:
    def __init__(self, root: str | os.PathLike, capacity_tokens: int, block_tokens: int,
                 identity: dict[str, Any], block_shape: tuple[int, ...]) -> None:
        self.block_tokens = block_tokens
        self.identity = identity_hash(identity)
        # [2, layers, block_tokens, slot bytes] uint8 (KVPool.gather)
        self.block_shape = block_shape
        self.payload_bytes = int(np.prod(block_shape))
        self.capacity_blocks = max(1, capacity_tokens // block_tokens)
        self.dir = Path(root) / self.identity.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "identity.json").write_text(json.dumps(identity, sort_keys=True, indent=1))
        others = [p.name for p in Path(root).iterdir() if p.is_dir() and p.name != self.dir.name]
        if others:
            logger.info(
                "disk KV cache: %d folder(s) in %s belong to another model, dtype or layout; "
                "they are ignored: %s",
                len(others),
                root,
                ", ".join(sorted(others)[:4]),
            )
        # LRU first; each block's page hashes once announced in KV events (None: not yet, e.g. a
        # block from an earlier run, whose tokens nobody has hashed since).
        self._index: OrderedDict[bytes, list[int] | None] = OrderedDict()
        self.on_drop: Callable[[list[int]], None] | None = None  # a dropped block's page hashes
        files = sorted(self.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                self._index[bytes.fromhex(path.stem)] = None
            except ValueError:
                continue
        for stale in self.dir.glob("*.tmp"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="radixserve-disk")
        self.written_blocks = 0
        self.loaded_blocks = 0
        self.corrupt_blocks = 0
        self._trim()
        if self._index:
            logger.info("disk KV cache: %d block(s) of %d tokens found in %s", len(self._index),
                        block_tokens, self.dir)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, name: bytes) -> bool:
        return name in self._index

    def _path(self, name: bytes) -> Path:
        return self.dir / (name.hex() + SUFFIX)

    def touch(self, names: Sequence[bytes]) -> None:
        """Mark a prefix's blocks as used, its first block most recent."""
        for name in reversed(names):
            if name in self._index:
                self._index.move_to_end(name)

    def unannounced(self, name: bytes) -> bool:
        return name in self._index and self._index[name] is None

    def announced(self, name: bytes, page_hashes: list[int]) -> None:
        self._index[name] = page_hashes

    def run_length(self, names: Sequence[bytes]) -> int:
        """How many leading blocks of ``names`` the store holds."""
        n = 0
        while n < len(names) and names[n] in self._index:
            n += 1
        return n

    def write(
        self, names: Sequence[bytes], blocks: Sequence[torch.Tensor], ready: Any = None
    ) -> None:
        """Store blocks (CPU tensors of ``block_shape``) in the background; ``ready``: a CUDA
        event the blocks' copy off the GPU completes (waited for on the I/O thread).  The
        caller touches the prefix's names (:meth:`touch`)."""
        for name, block in zip(names, blocks, strict=True):
            if name in self._index:
                continue
            self._index[name] = None
            self._io.submit(self._write_file, name, block, ready)
        self._trim()

    def load(self, names: Sequence[bytes]) -> Future[LoadResult]:
        """Read blocks in the background; the result holds the leading ones that are sound."""
        self.touch(names)
        return self._io.submit(self._read_files, list(names))

    def forget(self, names: Sequence[bytes]) -> None:
        """Drop blocks found bad by a load from the index (their files are already gone)."""
        for name in names:
            if name in self._index:  # not a block trimmed while its load was queued
                self._dropped(self._index.pop(name))
                self.corrupt_blocks += 1

    def close(self, timeout: float = 3.0) -> None:
        """Let queued writes finish (up to ``timeout`` seconds), then stop the I/O thread."""
        try:
            self._io.submit(lambda: None).result(timeout)
        except Exception:
            logger.warning("disk KV cache: writes still queued at shutdown were dropped")
        self._io.shutdown(wait=False, cancel_futures=True)

    def _trim(self) -> None:
        while len(self._index) > self.capacity_blocks:
            name, hashes = self._index.popitem(last=False)
            self._io.submit(self._path(name).unlink, True)
            self._dropped(hashes)

    def _dropped(self, page_hashes: list[int] | None) -> None:
        if page_hashes and self.on_drop is not None:
            self.on_drop(page_hashes)

    # ---- on the I/O thread -------------------------------------------------------------
    def _write_file(self, name: bytes, block: torch.Tensor, ready: Any = None) -> None:
        if ready is not None:
            ready.synchronize()
        payload = block.contiguous().view(torch.uint8).numpy()
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        path = self._path(name)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, self.identity, name, payload.nbytes, digest))
                f.write(payload)
            os.replace(tmp, path)
            self.written_blocks += 1
        except OSError:
            logger.exception("disk KV cache: could not write %s", path)
            tmp.unlink(missing_ok=True)

    def _read_block(self, name: bytes) -> torch.Tensor | None:
        path = self._path(name)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        problem = None
        if len(data) < _HEADER.size:
            problem = "truncated header"
        else:
            magic, ident, stored_name, size, digest = _HEADER.unpack_from(data)
            payload = memoryview(data)[_HEADER.size:]
            if magic != MAGIC or ident != self.identity or stored_name != name:
                problem = "header of another store or block"
            elif size != self.payload_bytes or len(payload) != size:
                problem = f"payload of {len(payload)} bytes, expected {self.payload_bytes}"
            elif hashlib.blake2b(payload, digest_size=16).digest() != digest:
                problem = "checksum mismatch"
        if problem is not None:
            logger.warning(
                "disk KV cache: %s is damaged (%s); deleted, not loaded", path.name, problem
            )
            path.unlink(missing_ok=True)
            return None
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return block.reshape(self.block_shape)

    def _read_files(self, names: list[bytes]) -> LoadResult:
        blocks: list[torch.Tensor] = []
        for i, name in enumerate(names):
            block = self._read_block(name)
            if block is None:
                return LoadResult(blocks, names[i : i + 1])
            blocks.append(block)
        self.loaded_blocks += len(blocks)
        return LoadResult(blocks, [])
