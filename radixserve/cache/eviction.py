"""The order in which the radix tree gives up its leaves.

Eviction pops the unlocked, unpinned leaf of lowest priority from a heap (O(log n) each):
  ``lru``   ``(last_access,)``: least recently used first
  ``lfu``   ``(hits, last_access)``: least often hit first, LRU among equals
  ``slru``  ``(hits >= 1, last_access)``: segmented LRU, scan resistant.  A prefix enters
            the tree *probationary* (its first use, the request that computed it) and is
            promoted to *protected* by its second use, the first admission that reuses it
            (e.g. a system prompt an agent sent twice); every probationary leaf goes before
            any protected one, LRU within each segment.
``hits`` counts admissions that reused the node (:meth:`record_hit`), not lookups: the request
that inserted a node is its first use and no hit, so ``hits`` is the number of uses minus one.
The heap uses lazy deletion: an entry ``(priority, node_id, node)`` is valid only while the node is
still in the tree, is a leaf, is unlocked and still has that priority; everything else is
skipped when popped. A fresh entry is pushed whenever a node becomes an evictable leaf or an
evictable leaf's priority changes. The heap is compacted when stale entries outnumber nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.cache.tree_node import TreeNode

EVICTION_POLICIES = ("lru", "lfu", "slru")
SLRU_PROTECT_HITS = 1  # reuses that promote an slru entry: its second use protects it


def priority_function(policy: str) -> Callable[[TreeNode], tuple[int, ...]]:
    """A leaf's eviction priority under ``policy`` (lowest goes first)."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {policy!r}")
    return {
        "lru": lambda n: (n.last_access,),
        "lfu": lambda n: (n.hits, n.last_access),
        "slru": lambda n: (int(n.hits >= SLRU_PROTECT_HITS), n.last_access),
    }[policy]


class LeafHeap:
    """A min-heap of ``(priority, node id, node)`` entries with lazy deletion: ``valid(entry)``
    says whether an entry still stands (its node still an evictable leaf of that priority);
    stale entries are skipped when popped and dropped when they outnumber the live nodes."""

    def __init__(self, valid: Callable[[tuple[Any, int, TreeNode]], bool]) -> None:
        self.entries: list[tuple[Any, int, TreeNode]] = []
        self.valid = valid

    def push(self, priority: Any, node: TreeNode, num_nodes: int) -> None:
        heapq.heappush(self.entries, (priority, node.id, node))
        if len(self.entries) > 2 * num_nodes + 64:
            live = {entry[1]: entry for entry in self.entries if self.valid(entry)}
            self.entries = list(live.values())
            heapq.heapify(self.entries)

    def pop(self) -> TreeNode | None:
        """The live leaf of lowest priority (removed), or None when there is none."""
        while self.entries:
            entry = heapq.heappop(self.entries)
            if self.valid(entry):
                return entry[2]
        return None

    def __len__(self) -> int:
        return len(self.entries)

    def live_ids(self) -> set[int]:
        return {entry[1] for entry in self.entries if self.valid(entry)}
