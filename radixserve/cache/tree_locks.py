"""Locks and pins on the radix tree's paths (the RadixCache is a TreeLocks).

A request holds the path of its cached prefix with :meth:`TreeLocks.inc_lock_ref` (undone by
:meth:`TreeLocks.dec_lock_ref`) so that eviction leaves it alone; a pin (:meth:`TreeLocks.pin`)
is such a lock that no request owns, counted apart in ``pin_ref`` so that the pinned size is
known.  These methods keep the tree's sizes (``evictable`` / ``protected`` / ``pinned``) and its
eviction heap right as the counts change.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.cache.tree_node import DEVICE, HOST, TreeNode


class TreeLocks:
    """The tree's parts these methods use are named here."""

    _evictable: int
    _protected: int
    _pinned: int
    _push_if_evictable: Callable[[TreeNode], None]

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
