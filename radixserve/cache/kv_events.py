"""KV events: what the radix tree holds, told to a router as it changes.

SGLang's event format, which smg, Dynamo and llm-d read: ``BlockStored`` (blocks that entered a
tier, with their tokens and the block before them), ``BlockRemoved`` (blocks that left a tier)
and ``AllBlocksCleared`` (the cache was flushed).  A block is one KV page (``block_size`` is
the page size).  Its hash is SGLang's: SHA-256 over the previous block's digest and the page's
token ids as little-endian uint32, the first 8 bytes read as a signed big-endian int64; the
first block of a cache salt's namespace chains from a digest of the salt, so equal tokens under
two salts never share a hash.  A consumer that hashes prompts the same way finds them; one that
indexes the events' tokens needs nothing but the chain.

``medium`` is the tier, in SGLang's names: ``GPU`` for the pool the model reads (SGLang's L1,
whatever the device: routers read it as "on the worker, ready"), ``CPU_PINNED`` for the host
tier and ``DISK`` for the disk tier.  A node moving between tiers is a removal from one and a
store in the other.  The disk tier (``cache/tiers``) announces a block when it writes it, or
when a request's tokens name a block an earlier run left there, and removes it when trimmed.

The tree calls :class:`KVEventRecorder` (``RadixCache.events``); the scheduler takes the
queued events after each step and hands them to the publisher (``ipc/kv_publisher.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from radixserve.cache.namespace import split_namespace
from radixserve.cache.tree_node import DEVICE, HOST, TreeNode

DISK = "disk"
MEDIUM = {DEVICE: "GPU", HOST: "CPU_PINNED", DISK: "DISK"}  # SGLang's names of the tiers
_SALT_TAG = b"sglang-cache-salt-v1\0"


def lora_id(name: str) -> int:
    """A LoRA adapter's id in the events (vLLM's ``lora_id`` is an integer): a digest of its
    name, the same on every worker that serves it under that name."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:7], "big")


def salt_digest(salt: str) -> bytes:
    """The digest a salted namespace's first block chains from ("" has none)."""
    return hashlib.sha256(_SALT_TAG + salt.encode("utf-8")).digest()


def page_digests(tokens: np.ndarray, page_size: int, prior: bytes | None) -> list[bytes]:
    """SHA-256 chain over the pages of ``tokens`` (whole pages), starting after ``prior``."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * page_size
    out = []
    for start in range(0, len(data), step):
        h = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
        h.update(data[start:start + step])
        prior = h.digest()
        out.append(prior)
    return out


def block_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class KVEventRecorder:
    """Queues the tree's changes as SGLang's KV events (msgpack-ready dicts), coalescing a
    store that continues the previous one, as SGLang does.  Disabled, it records nothing."""

    def __init__(self, page_size: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.page_size = page_size
        self.medium = MEDIUM
        self._queue: list[dict[str, Any]] = []
        self._salts: dict[int, str] = {}  # a namespace root's id -> its salt

    # ---------------------------------------------------------------- the tree's calls

    def new_root(self, root: TreeNode, namespace: str) -> None:
        if not self.enabled:
            return
        self._salts[root.id] = namespace
        root.digests = [salt_digest(namespace)] if namespace else []

    def forget_root(self, root: TreeNode) -> None:
        self._salts.pop(root.id, None)

    def stored(self, node: TreeNode, tier: str | None = None) -> None:
        if not self.enabled:
            return
        parent = node.parent
        parent_hash = None
        if parent is not None and parent.parent is not None:
            parent_hash = block_hash(self._digests(parent)[-1])
        hashes = [block_hash(d) for d in self._digests(node)]
        self.stored_pages(
            hashes, parent_hash, node.key.tolist(), tier or node.tier, self._salt(node)
        )

    def removed(self, node: TreeNode, tier: str | None = None) -> None:
        if self.enabled:
            self.removed_hashes([block_hash(d) for d in self._digests(node)], tier or node.tier)

    def stored_pages(self, hashes: list[int], parent_hash: int | None, tokens: list[int], tier: str,
                     salt: str = "") -> None:
        """Pages that entered ``tier`` (their hashes, the page before them, their tokens)."""
        medium = self.medium[tier]
        salt, adapter = split_namespace(salt)  # the tree's namespace: salt and LoRA adapter
        tail = self._queue[-1] if self._queue else None
        if (tail is not None and tail["type"] == "BlockStored" and tail.get("medium") == medium
                and tail.get("cache_salt", "") == salt and tail.get("lora_name") == adapter
                and tail["block_hashes"] and tail["block_hashes"][-1] == parent_hash):
            tail["block_hashes"].extend(hashes)
            tail["token_ids"].extend(tokens)
            return
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(hashes),
            "parent_block_hash": parent_hash,
            "token_ids": list(tokens),
            "block_size": self.page_size,
            "lora_id": None if adapter is None else lora_id(adapter),
            "medium": medium,
        }
        if salt:
            event["cache_salt"] = salt
        if adapter is not None:
            event["lora_name"] = adapter
        self._queue.append(event)

    def removed_hashes(self, hashes: list[int], tier: str) -> None:
        """Pages that left ``tier``."""
        medium = self.medium[tier]
        tail = self._queue[-1] if self._queue else None
        if tail is not None and tail["type"] == "BlockRemoved" and tail["medium"] == medium:
            tail["block_hashes"].extend(hashes)
        elif hashes:
            self._queue.append(
                {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
            )

    def page_hashes(self, tokens: np.ndarray, namespace: str) -> list[int]:
        """The hashes of the whole pages of a prompt of ``namespace`` (from position 0)."""
        whole = len(tokens) // self.page_size * self.page_size
        prior = salt_digest(namespace) if namespace else None
        return [block_hash(d) for d in page_digests(tokens[:whole], self.page_size, prior)]

    def cleared(self, root: TreeNode) -> None:
        """The tree is empty again, with ``root`` its unsalted root."""
        if not self.enabled:
            return
        self._queue.append({"type": "AllBlocksCleared"})
        self._salts.clear()
        self.new_root(root, "")

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``upper`` took the first pages of ``lower``'s run (a split): share out its digests."""
        if self.enabled and lower.digests is not None:
            pages = len(upper.value) // self.page_size
            upper.digests, lower.digests = lower.digests[:pages], lower.digests[pages:]

    # ---------------------------------------------------------------- the scheduler's

    def snapshot(self, roots: dict[str, TreeNode], nodes: list[TreeNode]) -> list[dict[str, Any]]:
        """Everything the tree holds, as a subscriber that starts now needs it: AllBlocksCleared,
        then a store of every node (``nodes``: parents before children) in its tier."""
        saved, self._queue = self._queue, [{"type": "AllBlocksCleared"}]
        for namespace, root in roots.items():
            self._salts[root.id] = namespace
        for node in nodes:
            self.stored(node)
        events, self._queue = self._queue, saved
        return events

    def take(self) -> list[dict[str, Any]]:
        events, self._queue = self._queue, []
        return events

    # ---------------------------------------------------------------- hashes

    def _digests(self, node: TreeNode) -> list[bytes]:
        if node.digests is None:
            parent = node.parent
            prior = None
            if parent is not None:
                above = (
                    self._digests(parent) if parent.parent is not None else (parent.digests or [])
                )
                prior = above[-1] if above else None
            node.digests = page_digests(node.key, self.page_size, prior)
        return node.digests

    def _salt(self, node: TreeNode) -> str:
        while node.parent is not None:
            node = node.parent
        return self._salts.get(node.id, "")
