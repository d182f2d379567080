"""The radix tree's nodes and match results, and the packed keys they compare.

Keys are compared as packed native int64 bytes: one ``memcmp`` per node instead of a Python
loop per token.  A request's tokens are packed once per call (``struct.pack`` for lists,
``tobytes`` for arrays).
"""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

ITEM_BYTES = 8  # bytes per token id in a packed key (native int64)
DEVICE, HOST = "device", "host"  # the tier a node's slots are in
EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_node_ids = itertools.count()


class TreeNode:
    """One run of tokens and their KV slots. The root has an empty key."""

    __slots__ = ("children", "parent", "key_bytes", "value", "lock_ref", "pin_ref", "last_access",
                 "hits", "id", "tier", "touched", "digests")

    def __init__(
        self, parent: TreeNode | None, key_bytes: bytes, value: np.ndarray, tier: str = DEVICE
    ) -> None:
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key_bytes = key_bytes  # packed int64 token ids
        self.value = value  # int64 KV slots of ``tier``, len(value) == len(key)
        self.tier = tier
        self.lock_ref = 0  # requests and pins holding this node (and so its ancestors)
        self.pin_ref = 0  # pins among them
        self.last_access = 0
        self.hits = 0  # admissions that reused this node
        self.id = next(_node_ids)
        self.touched = time.monotonic()  # wall clock of last_access (for people: /cache/tree)
        self.digests: list[bytes] | None = None  # per page, for KV events (cache/kv_events.py)

    @property
    def key(self) -> np.ndarray:
        """Token ids of this node (read-only int64 view)."""
        return np.frombuffer(self.key_bytes, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self)}, {self.tier}, lock_ref={self.lock_ref}, "
                f"pin_ref={self.pin_ref})")

    def has_device_child(self) -> bool:
        return any(child.tier == DEVICE for child in self.children.values())


class MatchResult(NamedTuple):
    slots: np.ndarray  # int64 device slots of the matched prefix's device part
    node: TreeNode  # deepest matched device node (a root when none matched)
    host_nodes: tuple[TreeNode, ...] = ()  # the matched host nodes below ``node``, top down

    @property
    def host_len(self) -> int:
        return sum(len(n.value) for n in self.host_nodes)


_packers: dict[int, struct.Struct] = {}  # per key length; cheaper than struct.pack's own cache


def pack_key(key: Sequence[int], length: int) -> bytes:
    """The first ``length`` token ids of ``key`` as native int64 bytes.

    Lists and tuples are packed token by token (``struct``); an int64 ndarray is nearly free.
    """
    if isinstance(key, (list, tuple)):
        if len(key) != length:
            key = key[:length]
        packer = _packers.get(length)
        if packer is None:
            if len(_packers) >= 4096:
                _packers.clear()
            packer = _packers[length] = struct.Struct(f"{length}q")
        return packer.pack(*key)
    if not isinstance(key, np.ndarray) or key.dtype != np.int64:
        key = np.asarray(key, dtype=np.int64)
    return key[:length].tobytes()


def common_len(a: bytes, b: bytes) -> int:
    """Number of leading token ids on which packed keys ``a`` and ``b`` (equal length) agree."""
    n = len(a) // ITEM_BYTES
    if n > 64:  # numpy's fixed overhead beats a binary search on long runs
        diff = np.frombuffer(a, dtype=np.int64) != np.frombuffer(b, dtype=np.int64)
        i = int(diff.argmax())
        return i if diff[i] else n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and the first mismatch is before hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * ITEM_BYTES] == b[: mid * ITEM_BYTES]:
            lo = mid
        else:
            hi = mid - 1
    return lo
