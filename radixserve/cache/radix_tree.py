"""Radix tree from token-id sequences to KV slot indices: the prefix cache.

Every non-root node holds a run of tokens (``key``) and the KV slots that store them
(``value``, int64, same length). With ``page_size > 1`` every run is a whole number of
pages and nodes are only ever split at page boundaries, so a node's slots are whole pages.

Keys are compared as packed int64 bytes (``tree_node.py``); ``tree_check.py`` recomputes the
invariants.

Namespaces: a request with a cache salt (``cache_salt`` / ``extra_key``) matches and inserts
under the root of its salt only, so two salts never share a node or a slot; no salt is the
namespace ``""``.  Every root has ``parent is None``; every other node in the tree has a parent.

Eviction pops the unlocked, unpinned device leaf of lowest priority (``cache/eviction.py``:
the policies ``lru``, ``lfu``, ``slru`` and the lazy-deletion heaps).

Pins (:meth:`pin`) hold a node's path like a lock that no request owns; ``pin_ref`` counts
them per node so that the pinned size is known (the scheduler caps it).  The lock and pin
counting is ``tree_locks.py``'s.

Tiers: every node's ``value`` holds slots of exactly one tier, ``tier``: ``DEVICE`` (the KV
pool the model reads) or ``HOST`` (the host pool of ``cache/tiers``).  Device nodes form the
top of every path (a device node's parent is a device node or a root): eviction takes a
device node only when no child of it is on the device (a *device leaf*), and hands it to
``demote``, which either gives it host slots (the node stays in the tree, on the host) or
refuses (the node and anything below it leave the tree); the moves are ``tree_tiers.py``'s.
A match walks both tiers and reports the host part apart (:attr:`MatchResult.host_nodes`).
Sizes (``evictable`` / ``protected``) count device tokens; ``host_size`` the host ones.
Every node that enters, leaves or changes tier is told to ``events`` (``cache/kv_events.py``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence

import numpy as np

from radixserve.cache import tree_node as tn
from radixserve.cache.eviction import LeafHeap, priority_function
from radixserve.cache.kv_events import KVEventRecorder
from radixserve.cache.tree_locks import TreeLocks
from radixserve.cache.tree_node import DEVICE, HOST, MatchResult, TreeNode
from radixserve.cache.tree_tiers import TierMoves


class RadixCache(TierMoves, TreeLocks):
    """Prefix cache over KV slots. Single-threaded: the scheduler owns it."""

    def __init__(
        self,
        page_size: int,
        free_slots: Callable[[np.ndarray], None],
        disable: bool = False,
        eviction_policy: str = "lru",
        demote: Callable[[TreeNode], np.ndarray | None] | None = None,
        free_host_slots: Callable[[np.ndarray], None] | None = None,
        events: KVEventRecorder | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._priority = priority_function(eviction_policy)
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.free_slots = free_slots
        # Tiers (cache/tiers): host slots for an evicted device node, or None to drop it.
        self.demote = demote
        self.free_host_slots = free_host_slots
        self.disable = disable
        self.events = events or KVEventRecorder(page_size, enabled=False)  # records nothing
        # Children are keyed by their first page: an int when page_size == 1, else a tuple.
        self._page_struct = struct.Struct(f"{page_size}q")
        self.reset()

    # ------------------------------------------------------------------ bookkeeping

    def reset(self) -> None:
        """Drop every node without calling ``free_slots`` (the caller resets its allocator)."""
        self.root = TreeNode(None, b"", tn.EMPTY_SLOTS)
        self._roots: dict[str, TreeNode] = {"": self.root}  # by namespace (cache salt)
        self.events.cleared(self.root)
        self._evictable = 0
        self._protected = 0
        self._pinned = 0
        self._host = 0
        self._num_nodes = 0  # excluding the roots
        self._clock = 0
        self.split_by_last_walk = False  # the latest match ended inside a node's run
        self._heap = LeafHeap(self._entry_valid)  # device leaves, in the policy's order
        self._host_heap = LeafHeap(self._host_entry_valid)  # host leaves, LRU

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def host_size(self) -> int:
        """Tokens whose slots are in the host tier."""
        return self._host

    def pinned_size(self) -> int:
        """Tokens on pinned paths (each counted once however many pins hold it)."""
        return self._pinned

    def root_of(self, namespace: str) -> TreeNode:
        """The root of a namespace (created on first use; dropped when it empties)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(None, b"", tn.EMPTY_SLOTS)
            self.events.new_root(root, namespace)
        return root

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def child_key(self, key_bytes: bytes, pos: int) -> int | tuple[int, ...]:
        page = self._page_struct.unpack_from(key_bytes, pos * tn.ITEM_BYTES)
        return page[0] if self.page_size == 1 else page

    def _push_if_evictable(self, node: TreeNode) -> None:
        if node.lock_ref or node.parent is None:
            return
        if node.tier == HOST:
            if not node.children:
                self._host_heap.push(node.last_access, node, self._num_nodes)
        elif not node.has_device_child():
            self._heap.push(self._priority(node), node, self._num_nodes)

    def _entry_valid(self, entry: tuple[tuple[int, ...], int, TreeNode]) -> bool:
        priority, _, node = entry
        return (
            node.parent is not None
            and node.tier == DEVICE
            and node.lock_ref == 0
            and not node.has_device_child()
            and self._priority(node) == priority
        )

    @staticmethod
    def _host_entry_valid(entry: tuple[int, int, TreeNode]) -> bool:
        last_access, _, node = entry
        return (node.parent is not None and node.tier == HOST and node.lock_ref == 0
                and not node.children and node.last_access == last_access)

    # ------------------------------------------------------------------ match / insert

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child`` after ``length`` tokens; return the new upper node (ending there).

        ``[0, length)`` of the child's run moves to a new node between the child and its
        parent; ``[length, len)`` stays on ``child``. Locks and access time are inherited, so
        sizes do not change.
        """
        parent = child.parent
        assert parent is not None
        cut = length * tn.ITEM_BYTES
        upper = TreeNode(parent, child.key_bytes[:cut], child.value[:length], child.tier)
        upper.lock_ref = child.lock_ref
        upper.pin_ref = child.pin_ref
        upper.last_access = child.last_access
        upper.touched = child.touched
        upper.hits = child.hits
        parent.children[self.child_key(child.key_bytes, 0)] = upper
        child.key_bytes = child.key_bytes[cut:]
        child.value = child.value[length:]
        child.parent = upper
        upper.children[self.child_key(child.key_bytes, 0)] = child
        self._num_nodes += 1
        self.events.split(upper, child)
        return upper

    def _walk(
        self, root: TreeNode, key_bytes: bytes, now: int, path: list[TreeNode] | None
    ) -> tuple[TreeNode, int]:
        """Follow ``key_bytes`` from ``root``; return (deepest node, matched tokens).

        Touches every matched node with ``now`` and splits the last one if the match ends
        inside it; appends the matched nodes to ``path`` when given.
        """
        n_tokens = len(key_bytes) // tn.ITEM_BYTES
        node, pos = root, 0
        wall = time.monotonic()
        self.split_by_last_walk = False
        while pos < n_tokens:
            child = node.children.get(self.child_key(key_bytes, pos))
            if child is None:
                break
            start = pos * tn.ITEM_BYTES
            child_len = len(child.value)
            if (
                pos + child_len <= n_tokens
                and key_bytes[start : start + len(child.key_bytes)] == child.key_bytes
            ):
                matched = child_len
            else:
                # The run [pos, pos + avail) of the key overlaps the child; find where they part.
                avail = min(child_len, n_tokens - pos)
                common = tn.common_len(
                    key_bytes[start : start + avail * tn.ITEM_BYTES],
                    child.key_bytes[: avail * tn.ITEM_BYTES],
                )
                matched = common - common % self.page_size  # >= 1 page: the first page matched
                child = self._split(child, matched)
                self.split_by_last_walk = True
            child.last_access = now
            child.touched = wall
            if path is not None:
                path.append(child)
            node, pos = child, pos + matched
            if matched < child_len:
                break
        if node.tier == HOST:  # the touched device node above the host part may be a device leaf
            above = node.parent
            while above is not None and above.tier == HOST:
                above = above.parent
            if above is not None:
                self._push_if_evictable(above)
        return node, pos

    def match_prefix(self, key: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` in ``namespace`` over both tiers: the
        device part's slots and deepest node (the namespace's root when nothing matched), and
        the host nodes that continue it."""
        aligned = len(key) // self.page_size * self.page_size
        root = self._roots.get(namespace)
        if self.disable or aligned == 0 or root is None:
            return MatchResult(tn.EMPTY_SLOTS, self.root if root is None else root)
        path: list[TreeNode] = []
        deepest, _ = self._walk(root, tn.pack_key(key, aligned), self._tick(), path)
        self._push_if_evictable(deepest)
        on_device = len(path)
        while on_device and path[on_device - 1].tier != DEVICE:
            on_device -= 1
        node = path[on_device - 1] if on_device else root
        host_nodes = tuple(path[on_device:])
        if not on_device:
            return MatchResult(tn.EMPTY_SLOTS, node, host_nodes)
        # Always a fresh array: the caller may write into it without touching the tree.
        slots = (
            path[0].value.copy()
            if on_device == 1
            else np.concatenate([n.value for n in path[:on_device]])
        )
        return MatchResult(slots, node, host_nodes)

    def insert(
        self, key: Sequence[int], slots: np.ndarray, namespace: str = "", tier: str = DEVICE
    ) -> int:
        """Cache the page-aligned part of ``key`` with ``slots``; return the already-cached length.

        With ``aligned = len(key) // page_size * page_size`` and ``cached`` the return value:
        ``[0, cached)`` was already in the tree (the caller keeps ownership of its own slots
        there and frees its duplicates), ``[cached, aligned)`` now belongs to the tree, and
        ``[aligned, len(key))`` is not inserted (the caller keeps it).

        ``tier`` is the tier of ``slots``.  Device slots also take the place of host nodes on
        the path (their host slots are freed): ``cached`` then ends where the host part began.
        Host slots (a disk load) only add what the tree lacks.
        """
        if len(key) != len(slots):
            raise ValueError(f"insert: len(key)={len(key)} != len(slots)={len(slots)}")
        aligned = len(key) // self.page_size * self.page_size
        if self.disable or aligned == 0:
            return 0
        key_bytes = tn.pack_key(key, aligned)
        path: list[TreeNode] | None = [] if tier == DEVICE and self._host else None
        node, walked = self._walk(self.root_of(namespace), key_bytes, self._tick(), path)
        cached = walked
        for upper in reversed(path or ()):  # a host part ends the path: it takes our device slots
            if upper.tier == DEVICE:
                break
            cached -= len(upper.value)
            self._adopt(upper, np.array(slots[cached : cached + len(upper.value)], dtype=np.int64))
        if walked < aligned:
            leaf = TreeNode(
                node,
                key_bytes[walked * tn.ITEM_BYTES :],
                np.array(slots[walked:aligned], dtype=np.int64),
                tier,
            )
            leaf.last_access = self._clock
            node.children[self.child_key(leaf.key_bytes, 0)] = leaf
            self._num_nodes += 1
            self.events.stored(leaf)
            if tier == DEVICE:
                self._evictable += aligned - walked
            else:
                self._host += aligned - walked
                self._push_if_evictable(node)  # touched by the walk; a host child changes nothing
            node = leaf
        self._push_if_evictable(node)
        return cached

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Take at least ``num_tokens`` (if possible) off the device from unlocked device
        leaves in the policy's order: each is demoted to the host tier or leaves the tree.
        Returns device tokens freed."""
        freed = 0
        while freed < num_tokens and (node := self._heap.pop()) is not None:
            freed += len(node.value)
            host_slots = self.demote(node) if self.demote is not None else None
            if host_slots is not None:
                self._to_host(node, host_slots)
                self._push_if_evictable(node)
                self._push_if_evictable(node.parent)
            else:
                self._evictable -= len(node.value)
                self.free_slots(node.value)
                self._drop(node)  # with any host nodes below it
        return freed

    def _drop(self, node: TreeNode) -> None:
        """Remove ``node`` and everything below it (host nodes) from the tree."""
        parent = node.parent
        assert parent is not None
        del parent.children[self.child_key(node.key_bytes, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.tier == HOST and len(n.value):
                self._host -= len(n.value)
                assert self.free_host_slots is not None
                self.free_host_slots(n.value)
            self.events.removed(n)
            n.parent = None  # marks every remaining heap entry of this node stale
            self._num_nodes -= 1
        if parent.parent is None and not parent.children and parent is not self.root:
            # emptied namespace
            self._roots = {k: r for k, r in self._roots.items() if r is not parent}
            self.events.forget_root(parent)
        self._push_if_evictable(parent)

    # ------------------------------------------------------------------ inspection

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        out: list[TreeNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_slots(self, tier: str = DEVICE) -> np.ndarray:
        """Every slot of ``tier`` held by the tree."""
        values = [node.value for node in self._nodes() if node.tier == tier]
        return np.concatenate(values) if values else tn.EMPTY_SLOTS.copy()
