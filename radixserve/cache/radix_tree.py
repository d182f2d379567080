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
"""

from __future__ import annotations

import heapq
import itertools
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn

import numpy as np

_ITEM = 8  # bytes per token id in a packed key (native int64)
EVICTION_POLICIES = ("lru", "lfu", "slru")
SLRU_PROTECT_HITS = 2  # hits after which an slru entry is protected
_EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_node_ids = itertools.count()


class TreeNode:
    """One run of tokens and their KV slots. The root has an empty key."""

    __slots__ = ("children", "parent", "key_bytes", "value", "lock_ref", "pin_ref", "last_access",
                 "hits", "id")

    def __init__(self, parent: TreeNode | None, key_bytes: bytes, value: np.ndarray) -> None:
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key_bytes = key_bytes  # packed int64 token ids
        self.value = value  # int64 KV slots, len(value) == len(key)
        self.lock_ref = 0  # requests and pins holding this node (and so its ancestors)
        self.pin_ref = 0  # pins among them
        self.last_access = 0
        self.hits = 0  # admissions that reused this node
        self.id = next(_node_ids)

    @property
    def key(self) -> np.ndarray:
        """Token ids of this node (read-only int64 view)."""
        return np.frombuffer(self.key_bytes, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self)}, lock_ref={self.lock_ref}, pin_ref={self.pin_ref})"


class MatchResult(NamedTuple):
    slots: np.ndarray  # int64 slots of the matched prefix; len == matched length
    node: TreeNode  # deepest matched node (root when nothing matched)


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
        self._num_nodes = 0  # excluding the roots
        self._clock = 0
        self._heap: list[tuple[tuple[int, ...], int, TreeNode]] = []

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

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
        if not node.children and node.lock_ref == 0 and node.parent is not None:
            heapq.heappush(self._heap, (self._priority(node), node.id, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._compact_heap()

    def _entry_valid(self, entry: tuple[tuple[int, ...], int, TreeNode]) -> bool:
        priority, _, node = entry
        return (
            node.parent is not None
            and not node.children
            and node.lock_ref == 0
            and self._priority(node) == priority
        )

    def _compact_heap(self) -> None:
        live: dict[int, tuple[tuple[int, ...], int, TreeNode]] = {}
        for entry in self._heap:
            if self._entry_valid(entry):
                live[entry[1]] = entry
        self._heap[:] = live.values()  # in place: evict() holds a reference
        heapq.heapify(self._heap)

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
        upper = TreeNode(parent, child.key_bytes[:cut], child.value[:length])
        upper.lock_ref = child.lock_ref
        upper.pin_ref = child.pin_ref
        upper.last_access = child.last_access
        upper.hits = child.hits
        parent.children[self._child_key(child.key_bytes, 0)] = upper
        child.key_bytes = child.key_bytes[cut:]
        child.value = child.value[length:]
        child.parent = upper
        upper.children[self._child_key(child.key_bytes, 0)] = child
        self._num_nodes += 1
        return upper

    def _walk(
        self, root: TreeNode, key_bytes: bytes, now: int, values: list[np.ndarray] | None
    ) -> tuple[TreeNode, int]:
        """Follow ``key_bytes`` from ``root``; return (deepest node, matched tokens).

        Touches every matched node with ``now`` and splits the last one if the match ends
        inside it; appends matched values to ``values`` when given.
        """
        n_tokens = len(key_bytes) // _ITEM
        node, pos = root, 0
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
            child.last_access = now
            if values is not None:
                values.append(child.value)
            node, pos = child, pos + matched
            if matched < child_len:
                break
        return node, pos

    def match_prefix(self, key: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` in ``namespace``: its slots and its
        deepest node (the namespace's root when nothing matched)."""
        aligned = len(key) // self.page_size * self.page_size
        root = self._roots.get(namespace)
        if self.disable or aligned == 0 or root is None:
            return MatchResult(_EMPTY_SLOTS, self.root if root is None else root)
        values: list[np.ndarray] = []
        node, _ = self._walk(root, _pack(key, aligned), self._tick(), values)
        self._push_if_evictable(node)
        if not values:
            return MatchResult(_EMPTY_SLOTS, node)
        # Always a fresh array: the caller may write into it without touching the tree.
        slots = values[0].copy() if len(values) == 1 else np.concatenate(values)
        return MatchResult(slots, node)

    def insert(self, key: Sequence[int], slots: np.ndarray, namespace: str = "") -> int:
        """Cache the page-aligned part of ``key`` with ``slots``; return the already-cached length.

        With ``aligned = len(key) // page_size * page_size`` and ``cached`` the return value:
        ``[0, cached)`` was already in the tree (the caller keeps ownership of its own slots
        there and frees its duplicates), ``[cached, aligned)`` now belongs to the tree, and
        ``[aligned, len(key))`` is not inserted (the caller keeps it).
        """
        if len(key) != len(slots):
            raise ValueError(f"insert: len(key)={len(key)} != len(slots)={len(slots)}")
        aligned = len(key) // self.page_size * self.page_size
        if self.disable or aligned == 0:
            return 0
        key_bytes = _pack(key, aligned)
        node, cached = self._walk(self.root_of(namespace), key_bytes, self._tick(), None)
        if cached < aligned:
            leaf = TreeNode(
                node, key_bytes[cached * _ITEM :], np.array(slots[cached:aligned], dtype=np.int64)
            )
            leaf.last_access = self._clock
            node.children[self._child_key(leaf.key_bytes, 0)] = leaf
            self._num_nodes += 1
            self._evictable += aligned - cached
            node = leaf
        self._push_if_evictable(node)
        return cached

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
            if node.lock_ref == 0:
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
            if node.lock_ref == 0:
                self._protected -= len(node.value)
                self._evictable += len(node.value)
            node = node.parent  # type: ignore[assignment]
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
        """Free at least ``num_tokens`` (if possible) from unlocked leaves in the policy's
        order; return tokens freed."""
        freed = 0
        heap = self._heap
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            if not self._entry_valid(entry):
                continue
            node = entry[2]
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key_bytes, 0)]
            node.parent = None  # marks every remaining heap entry of this node stale
            self._num_nodes -= 1
            self._evictable -= len(node.value)
            freed += len(node.value)
            self.free_slots(node.value)
            if parent.parent is None and not parent.children and parent is not self.root:
                self._roots = {k: r for k, r in self._roots.items() if r is not parent}  # emptied namespace
            self._push_if_evictable(parent)
        return freed

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

    def all_slots(self) -> np.ndarray:
        """Every KV slot held by the tree."""
        values = [node.value for node in self._nodes()]
        return np.concatenate(values) if values else _EMPTY_SLOTS.copy()

    def check_invariants(self) -> None:
        """Recompute sizes, locks, keys and the leaf heap; raise RuntimeError on any mismatch."""

        def fail(msg: str) -> NoReturn:
            raise RuntimeError(f"RadixCache invariant violated: {msg}")

        for root in self._roots.values():
            if root.key_bytes or len(root.value) or root.lock_ref or root.pin_ref or root.parent is not None:
                fail("a root must have an empty key, no value, no lock and no parent")
        evictable = protected = pinned = 0
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
        if len(nodes) != self._num_nodes:
            fail(f"tracked {self._num_nodes} nodes, found {len(nodes)}")
        slots = self.all_slots()
        if len(np.unique(slots)) != len(slots):
            fail("a KV slot is held by two tree positions")
        in_heap = {entry[1] for entry in self._heap if self._entry_valid(entry)}
        for node in nodes:
            if not node.children and node.lock_ref == 0 and node.id not in in_heap:
                fail(f"evictable leaf {node!r} has no valid heap entry")

    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump of the tree for debugging."""
        lines = [f"root (evictable={self._evictable}, protected={self._protected})"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                toks = child.key[:max_tokens].tolist()
                more = "..." if len(child) > max_tokens else ""
                lines.append(
                    f"{'  ' * depth}{toks}{more} len={len(child)} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                visit(child, depth + 1)

        for namespace, root in self._roots.items():
            if namespace:
                lines.append(f"  namespace {namespace!r}")
            visit(root, 2 if namespace else 1)
        return "\n".join(lines)
