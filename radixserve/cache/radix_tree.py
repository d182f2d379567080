"""Radix tree from token-id sequences to KV slot indices: the prefix cache.

Every non-root node holds a run of tokens (``key``) and the KV slots that store them
(``value``, int64, same length). With ``page_size > 1`` every run is a whole number of
pages and nodes are only ever split at page boundaries, so a node's slots are whole pages.

Keys are compared as packed native int64 bytes: one ``memcmp`` per node instead of a
Python loop per token. A request's tokens are packed once per call (``struct.pack`` for
lists, ``tobytes`` for arrays).

Namespaces: a request with a cache salt (``cache_salt`` / ``extra_key``) matches and inserts
under the root of its salt only, so two salts never share a node or a slot; no salt is the
namespace ``""``.  Every root has ``parent is None``; every other node in the tree has a parent.

Eviction pops the unlocked, unpinned leaf of lowest priority from a heap (O(log n) each):
  ``lru``   ``(last_access,)``: least recently used first
  ``lfu``   ``(hits, last_access)``: least often hit first, LRU among equals
  ``slru``  ``(hits >= 2, last_access)``: segmented LRU, scan resistant.  A prefix hit fewer
            than twice (a one-off prompt) is *probationary* and goes before any *protected*
            one (hit at least twice, e.g. a system prompt every agent sends); LRU within each
            segment.
``hits`` counts admissions that reused the node (:meth:`record_hit`), not lookups.  The heap
uses lazy deletion: an entry ``(priority, node_id, node)`` is valid only while the node is
still in the tree, is a leaf, is unlocked and still has that priority; everything else is
skipped when popped. A fresh entry is pushed whenever a node becomes an evictable leaf or an
evictable leaf's priority changes. The heap is compacted when stale entries outnumber nodes.

Pins (:meth:`pin`) hold a node's path like a lock that no request owns; ``pin_ref`` counts
them per node so that the pinned size is known (the scheduler caps it).

Tiers: every node's ``value`` holds slots of exactly one tier, ``tier``: ``DEVICE`` (the KV
pool the model reads) or ``HOST`` (the host pool of ``cache/tiers``).  Device nodes form the
top of every path (a device node's parent is a device node or a root): eviction takes a
device node only when no child of it is on the device (a *device leaf*), and hands it to
``demote``, which either gives it host slots (the node stays in the tree, on the host) or
refuses (the node and anything below it leave the tree).  Host leaves are dropped in LRU
order by :meth:`evict_host`.  A match walks both tiers and reports the host part apart
(:attr:`MatchResult.host_nodes`); the caller promotes it (:meth:`promote`) top down.
Sizes (``evictable`` / ``protected``) count device tokens; ``host_size`` the host ones.
"""

from __future__ import annotations

import heapq
import itertools
import struct
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn

import numpy as np

_ITEM = 8  # bytes per token id in a packed key (native int64)
EVICTION_POLICIES = ("lru", "lfu", "slru")
DEVICE, HOST = "device", "host"  # the tier a node's slots are in
SLRU_PROTECT_HITS = 2  # hits after which an slru entry is protected
_EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_node_ids = itertools.count()


class TreeNode:
    """One run of tokens and their KV slots. The root has an empty key."""

    __slots__ = ("children", "parent", "key_bytes", "value", "lock_ref", "pin_ref", "last_access",
                 "hits", "id", "tier", "touched")

    def __init__(self, parent: TreeNode | None, key_bytes: bytes, value: np.ndarray, tier: str = DEVICE) -> None:
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


def _pack(key: Sequence[int], length: int) -> bytes:
    """The first ``length`` token ids of ``key`` as native int64 bytes.

    Lists and tuples cost ~6 ns per token (``struct``); an int64 ndarray is nearly free.
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


def _common_len(a: bytes, b: bytes) -> int:
    """Number of leading token ids on which packed keys ``a`` and ``b`` (equal length) agree."""
    n = len(a) // _ITEM
    if n > 64:  # numpy's fixed overhead beats a binary search on long runs
        diff = np.frombuffer(a, dtype=np.int64) != np.frombuffer(b, dtype=np.int64)
        i = int(diff.argmax())
        return i if diff[i] else n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and the first mismatch is before hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * _ITEM] == b[: mid * _ITEM]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixCache:
    """Prefix cache over KV slots. Single-threaded: the scheduler owns it."""

    def __init__(
        self,
        page_size: int,
        free_slots: Callable[[np.ndarray], None],
        disable: bool = False,
        eviction_policy: str = "lru",
        demote: Callable[[TreeNode], np.ndarray | None] | None = None,
        free_host_slots: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._priority: Callable[[TreeNode], tuple[int, ...]] = {
            "lru": lambda n: (n.last_access,),
            "lfu": lambda n: (n.hits, n.last_access),
            "slru": lambda n: (int(n.hits >= SLRU_PROTECT_HITS), n.last_access),
        }[eviction_policy]
        self.free_slots = free_slots
        # Tiers (cache/tiers): host slots for an evicted device node, or None to drop it.
        self.demote = demote
        self.free_host_slots = free_host_slots
        self.disable = disable
        # Children are keyed by their first page: an int when page_size == 1, else a tuple.
        self._page_struct = struct.Struct(f"{page_size}q")
        self.reset()

    # ------------------------------------------------------------------ bookkeeping

    def reset(self) -> None:
        """Drop every node without calling ``free_slots`` (the caller resets its allocator)."""
        self.root = TreeNode(None, b"", _EMPTY_SLOTS)
        self._roots: dict[str, TreeNode] = {"": self.root}  # by namespace (cache salt)
        self._evictable = 0
        self._protected = 0
        self._pinned = 0
        self._host = 0
        self._num_nodes = 0  # excluding the roots
        self._clock = 0
        self.split_by_last_walk = False  # the latest match ended inside a node's run
        self._heap: list[tuple[tuple[int, ...], int, TreeNode]] = []  # device leaves
        self._host_heap: list[tuple[int, int, TreeNode]] = []  # host leaves, LRU

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
            root = self._roots[namespace] = TreeNode(None, b"", _EMPTY_SLOTS)
        return root

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key_bytes: bytes, pos: int) -> int | tuple[int, ...]:
        page = self._page_struct.unpack_from(key_bytes, pos * _ITEM)
        return page[0] if self.page_size == 1 else page

    def _push_if_evictable(self, node: TreeNode) -> None:
        if node.lock_ref or node.parent is None:
            return
        if node.tier == HOST:
            if not node.children:
                heapq.heappush(self._host_heap, (node.last_access, node.id, node))
                if len(self._host_heap) > 2 * self._num_nodes + 64:
                    self._compact_heap(self._host_heap, self._host_entry_valid)
        elif not node.has_device_child():
            heapq.heappush(self._heap, (self._priority(node), node.id, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._compact_heap(self._heap, self._entry_valid)

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

    @staticmethod
    def _compact_heap(heap: list, valid: Callable[[tuple], bool]) -> None:
        live = {entry[1]: entry for entry in heap if valid(entry)}
        heap[:] = live.values()  # in place: evict() holds a reference
        heapq.heapify(heap)

    # ------------------------------------------------------------------ match / insert

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut ``child`` after ``length`` tokens; return the new upper node (ending there).

        ``[0, length)`` of the child's run moves to a new node between the child and its
        parent; ``[length, len)`` stays on ``child``. Locks and access time are inherited, so
        sizes do not change.
        """
        parent = child.parent
        assert parent is not None
        cut = length * _ITEM
        upper = TreeNode(parent, child.key_bytes[:cut], child.value[:length], child.tier)
        upper.lock_ref = child.lock_ref
        upper.pin_ref = child.pin_ref
        upper.last_access = child.last_access
        upper.touched = child.touched
        upper.hits = child.hits
        parent.children[self._child_key(child.key_bytes, 0)] = upper
        child.key_bytes = child.key_bytes[cut:]
        child.value = child.value[length:]
        child.parent = upper
        upper.children[self._child_key(child.key_bytes, 0)] = child
        self._num_nodes += 1
        return upper

    def _walk(
        self, root: TreeNode, key_bytes: bytes, now: int, path: list[TreeNode] | None
    ) -> tuple[TreeNode, int]:
        """Follow ``key_bytes`` from ``root``; return (deepest node, matched tokens).

        Touches every matched node with ``now`` and splits the last one if the match ends
        inside it; appends the matched nodes to ``path`` when given.
        """
        n_tokens = len(key_bytes) // _ITEM
        node, pos = root, 0
        wall = time.monotonic()
        self.split_by_last_walk = False
        while pos < n_tokens:
            child = node.children.get(self._child_key(key_bytes, pos))
            if child is None:
                break
            start = pos * _ITEM
            child_len = len(child.value)
            if (
                pos + child_len <= n_tokens
                and key_bytes[start : start + len(child.key_bytes)] == child.key_bytes
            ):
                matched = child_len
            else:
                # The run [pos, pos + avail) of the key overlaps the child; find where they part.
                avail = min(child_len, n_tokens - pos)
                common = _common_len(
                    key_bytes[start : start + avail * _ITEM], child.key_bytes[: avail * _ITEM]
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
            return MatchResult(_EMPTY_SLOTS, self.root if root is None else root)
        path: list[TreeNode] = []
        deepest, _ = self._walk(root, _pack(key, aligned), self._tick(), path)
        self._push_if_evictable(deepest)
        on_device = len(path)
        while on_device and path[on_device - 1].tier != DEVICE:
            on_device -= 1
        node = path[on_device - 1] if on_device else root
        host_nodes = tuple(path[on_device:])
        if not on_device:
            return MatchResult(_EMPTY_SLOTS, node, host_nodes)
        # Always a fresh array: the caller may write into it without touching the tree.
        slots = path[0].value.copy() if on_device == 1 else np.concatenate([n.value for n in path[:on_device]])
        return MatchResult(slots, node, host_nodes)

    def insert(self, key: Sequence[int], slots: np.ndarray, namespace: str = "", tier: str = DEVICE) -> int:
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
        key_bytes = _pack(key, aligned)
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
                node, key_bytes[walked * _ITEM :], np.array(slots[walked:aligned], dtype=np.int64), tier
            )
            leaf.last_access = self._clock
            node.children[self._child_key(leaf.key_bytes, 0)] = leaf
            self._num_nodes += 1
            if tier == DEVICE:
                self._evictable += aligned - walked
            else:
                self._host += aligned - walked
                self._push_if_evictable(node)  # touched by the walk; a host child changes nothing
            node = leaf
        self._push_if_evictable(node)
        return cached

    def _adopt(self, node: TreeNode, device_slots: np.ndarray) -> None:
        """Host ``node`` takes ``device_slots`` (same tokens) and frees its host slots."""
        host_slots, n = node.value, len(node.value)
        node.value, node.tier = device_slots, DEVICE
        self._host -= n
        if node.lock_ref:
            self._protected += n
        else:
            self._evictable += n
        assert self.free_host_slots is not None
        self.free_host_slots(host_slots)

    def promote(self, node: TreeNode, device_slots: np.ndarray) -> None:
        """Move host ``node`` to the device: it now holds ``device_slots``, into which the
        caller copied its KV.  Its parent must be on the device already (promote top down)."""
        parent = node.parent
        if node.tier != HOST or parent is None or (parent.parent is not None and parent.tier != DEVICE):
            raise RuntimeError(f"promote of {node!r}: not a host node below the device part")
        if len(device_slots) != len(node.value):
            raise ValueError(f"promote: {len(device_slots)} slots for {len(node.value)} tokens")
        self._adopt(node, np.asarray(device_slots, dtype=np.int64))
        self._push_if_evictable(node)

    # ------------------------------------------------------------------ locks and eviction

    def record_hit(self, node: TreeNode) -> None:
        """An admission reused the path ending at ``node``: count a hit on each of its nodes."""
        start = node
        while node.parent is not None:
            node.hits += 1
            node = node.parent
        self._push_if_evictable(start)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Hold ``node`` and its ancestors (not the root) against eviction."""
        while node.parent is not None:
            if node.lock_ref == 0 and node.tier == DEVICE:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``; a path that drops to zero becomes evictable."""
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        start = node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"lock_ref of ancestor {node!r} would go negative")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.tier == DEVICE:
                self._protected -= len(node.value)
                self._evictable += len(node.value)
            node = node.parent  # type: ignore[assignment]
        self._push_if_evictable(start)
        while start.tier == HOST and start.parent is not None:  # and the device leaf above it
            start = start.parent
            self._push_if_evictable(start)

    def pin(self, node: TreeNode) -> None:
        """Keep the path ending at ``node`` in the tree until :meth:`unpin`."""
        self.inc_lock_ref(node)
        while node.parent is not None:
            if node.pin_ref == 0:
                self._pinned += len(node.value)
            node.pin_ref += 1
            node = node.parent

    def unpin(self, node: TreeNode) -> None:
        """Undo one :meth:`pin` of ``node``."""
        walk = node
        while walk.parent is not None:
            if walk.pin_ref <= 0:
                raise RuntimeError(f"unpin of unpinned {walk!r}")
            walk.pin_ref -= 1
            if walk.pin_ref == 0:
                self._pinned -= len(walk.value)
            walk = walk.parent
        self.dec_lock_ref(node)

    def evict(self, num_tokens: int) -> int:
        """Take at least ``num_tokens`` (if possible) off the device from unlocked device
        leaves in the policy's order: each is demoted to the host tier or leaves the tree.
        Returns device tokens freed."""
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            if not self._entry_valid(entry):
                continue
            node = entry[2]
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

    def _to_host(self, node: TreeNode, host_slots: np.ndarray) -> None:
        """Device ``node`` (unlocked) now lives in ``host_slots``; its device slots are freed."""
        n = len(node.value)
        self.free_slots(node.value)
        node.value, node.tier = host_slots, HOST
        self._evictable -= n
        self._host += n

    def demote_path(self, node: TreeNode) -> int:
        """Demote ``node`` and then its ancestors while each is an unlocked device leaf (a
        retracted request's own KV, swapped out); return the tokens moved to the host.  What
        it moved is held while it goes on, so that making host room for a parent never drops
        a child it just demoted."""
        moved: list[TreeNode] = []
        while (node.parent is not None and node.tier == DEVICE and node.lock_ref == 0
               and not node.has_device_child() and self.demote is not None):
            host_slots = self.demote(node)
            if host_slots is None:
                break
            self._to_host(node, host_slots)
            node.lock_ref += 1  # a host node: no size moves; released below
            moved.append(node)
            node = node.parent
        for done in moved:
            done.lock_ref -= 1
            self._push_if_evictable(done)
        self._push_if_evictable(node)
        return sum(len(done.value) for done in moved)

    def evict_host(self, num_tokens: int) -> int:
        """Drop at least ``num_tokens`` (if possible) of host leaves, least recently used
        first; return host tokens freed."""
        freed = 0
        heap = self._host_heap
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            if not self._host_entry_valid(entry):
                continue
            freed += len(entry[2].value)
            self._drop(entry[2])
        return freed

    def _drop(self, node: TreeNode) -> None:
        """Remove ``node`` and everything below it (host nodes) from the tree."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key_bytes, 0)]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.tier == HOST and len(n.value):
                self._host -= len(n.value)
                assert self.free_host_slots is not None
                self.free_host_slots(n.value)
            n.parent = None  # marks every remaining heap entry of this node stale
            self._num_nodes -= 1
        if parent.parent is None and not parent.children and parent is not self.root:
            self._roots = {k: r for k, r in self._roots.items() if r is not parent}  # emptied namespace
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
        return np.concatenate(values) if values else _EMPTY_SLOTS.copy()

    def check_invariants(self) -> None:
        """Recompute sizes, locks, keys and the leaf heap; raise RuntimeError on any mismatch."""

        def fail(msg: str) -> NoReturn:
            raise RuntimeError(f"RadixCache invariant violated: {msg}")

        for root in self._roots.values():
            if root.key_bytes or len(root.value) or root.lock_ref or root.pin_ref or root.parent is not None:
                fail("a root must have an empty key, no value, no lock and no parent")
        evictable = protected = pinned = host = 0
        nodes = self._nodes()
        for node in nodes:
            parent = node.parent
            if parent is None:
                fail(f"{node!r} reachable but has no parent")
            n = len(node.value)
            if n == 0 or n % self.page_size:
                fail(f"{node!r} has length {n}, not a positive multiple of {self.page_size}")
            if len(node.key_bytes) != n * _ITEM or node.value.dtype != np.int64:
                fail(
                    f"{node!r} key/value mismatch (key bytes {len(node.key_bytes)}, dtype {node.value.dtype})"
                )
            if parent.children.get(self._child_key(node.key_bytes, 0)) is not node:
                fail(f"{node!r} is not stored under its first page in its parent")
            if node.lock_ref < 0 or not 0 <= node.pin_ref <= node.lock_ref:
                fail(f"{node!r} has a negative lock_ref or pin_ref, or more pins than locks")
            if parent.parent is not None and (parent.lock_ref < node.lock_ref or parent.pin_ref < node.pin_ref):
                fail(f"{parent!r} has a smaller lock_ref or pin_ref than its child {node!r}")
            if node.tier not in (DEVICE, HOST):
                fail(f"{node!r} has an unknown tier")
            if node.tier == DEVICE and parent.parent is not None and parent.tier != DEVICE:
                fail(f"device node {node!r} below host node {parent!r}")
            if node.tier == HOST:
                host += n
                if node.pin_ref:
                    fail(f"pinned node {node!r} is not on the device")
                continue
            if node.pin_ref:
                pinned += n
            if node.lock_ref:
                protected += n
            else:
                evictable += n
        if (evictable, protected) != (self._evictable, self._protected):
            fail(
                f"sizes: tracked evictable={self._evictable} protected={self._protected}, "
                f"recomputed evictable={evictable} protected={protected}"
            )
        if pinned != self._pinned:
            fail(f"pinned size: tracked {self._pinned}, recomputed {pinned}")
        if host != self._host:
            fail(f"host size: tracked {self._host}, recomputed {host}")
        if len(nodes) != self._num_nodes:
            fail(f"tracked {self._num_nodes} nodes, found {len(nodes)}")
        for tier in (DEVICE, HOST):
            slots = self.all_slots(tier)
            if len(np.unique(slots)) != len(slots):
                fail(f"a {tier} slot is held by two tree positions")
        in_heap = {entry[1] for entry in self._heap if self._entry_valid(entry)}
        in_host_heap = {entry[1] for entry in self._host_heap if self._host_entry_valid(entry)}
        for node in nodes:
            if node.lock_ref:
                continue
            if node.tier == DEVICE and not node.has_device_child() and node.id not in in_heap:
                fail(f"evictable device leaf {node!r} has no valid heap entry")
            if node.tier == HOST and not node.children and node.id not in in_host_heap:
                fail(f"host leaf {node!r} has no valid heap entry")

    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump of the tree for debugging."""
        lines = [f"root (evictable={self._evictable}, protected={self._protected})"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                toks = child.key[:max_tokens].tolist()
                more = "..." if len(child) > max_tokens else ""
                lines.append(
                    f"{'  ' * depth}{toks}{more} len={len(child)} {child.tier} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                visit(child, depth + 1)

        for namespace, root in self._roots.items():
            if namespace:
                lines.append(f"  namespace {namespace!r}")
            visit(root, 2 if namespace else 1)
        return "\n".join(lines)
