"""Pinned prefixes: paths of the radix tree that eviction never takes (``POST /cache/pin``).

A pin is made when a prefill-only request asking for it finishes: its prompt is then in the
tree, and the pin holds the cached (page-aligned) path through :meth:`RadixCache.pin` before
anything else can run.  Pinned tokens are capped at ``max_pinned_fraction`` of the KV pool; a
pin beyond the cap is refused with a message saying by how much.  A pin may expire (a TTL in
seconds); expired pins are dropped at the next step or listing.  ``flush_cache`` drops the tree
and with it every pin.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.cache.namespace import split_namespace
from radixserve.cache.radix_tree import RadixCache, TreeNode
from radixserve.ipc.messages import PinResult


@dataclass
class Pin:
    pin_id: str
    node: TreeNode  # deepest node of the pinned path
    key: bytes  # the token ids asked for (int64 bytes): unpinning by content compares these
    namespace: str  # cache salt and LoRA adapter (cache/namespace.py)
    tokens: int  # length of the pinned path
    expires_at: float | None  # time.monotonic() deadline

    def describe(self, now: float) -> dict[str, Any]:
        salt, adapter = split_namespace(self.namespace)
        d = {"pin_id": self.pin_id, "tokens": self.tokens, "cache_salt": salt or None,
             "expires_in": None if self.expires_at is None else max(0.0, self.expires_at - now)}
        return d if adapter is None else {**d, "lora": adapter}


class Pins:
    def __init__(self, tree: RadixCache, cap_tokens: int) -> None:
        self.tree = tree
        self.cap_tokens = cap_tokens
        self._pins: dict[str, Pin] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, ids: np.ndarray, namespace: str, ttl: float | None) -> PinResult:
        """Pin the cached path of ``ids``: the pin, or why none was made."""
        result = self.tree.match_prefix(ids, namespace)
        tokens = len(result.slots)
        if tokens == 0:
            return PinResult(
                error="nothing of this prompt is cached (shorter than a page, or the cache is off)"
            )
        extra, node = 0, result.node
        while node.parent is not None:  # tokens of the path no pin holds yet
            extra += len(node.value) if node.pin_ref == 0 else 0
            node = node.parent
        if self.tree.pinned_size() + extra > self.cap_tokens:
            return PinResult(
                error=f"pinning {extra} more tokens would exceed the pinned-prefix cap of "
                f"{self.cap_tokens} tokens (--max-pinned-fraction); "
                f"{self.tree.pinned_size()} are pinned now"
            )
        self.tree.pin(result.node)
        pin = Pin(
            f"pin-{next(self._ids)}",
            result.node,
            np.asarray(ids, dtype=np.int64).tobytes(),
            namespace,
            tokens,
            None if ttl is None else time.monotonic() + ttl,
        )
        self._pins[pin.pin_id] = pin
        return PinResult(**pin.describe(time.monotonic()))

    def unpin(
        self, pin_id: str | None = None, ids: list[int] | None = None, namespace: str = ""
    ) -> list[str]:
        """Drop the pin ``pin_id``, or every pin of exactly ``ids`` in ``namespace``; their ids."""
        if pin_id is not None:
            gone = [pin_id] if pin_id in self._pins else []
        else:
            key = np.asarray(ids or [], dtype=np.int64).tobytes()
            gone = [
                p.pin_id for p in self._pins.values() if p.key == key and p.namespace == namespace
            ]
        for name in gone:
            self.tree.unpin(self._pins.pop(name).node)
        return gone

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for pin in [
            p for p in self._pins.values() if p.expires_at is not None and p.expires_at <= now
        ]:
            self.unpin(pin.pin_id)

    def listing(self) -> list[dict[str, Any]]:
        self.expire()
        now = time.monotonic()
        return [p.describe(now) for p in self._pins.values()]

    def clear(self) -> None:
        """The tree was reset (flush): every pin went with it."""
        self._pins.clear()
