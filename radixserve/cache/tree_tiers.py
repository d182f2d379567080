"""How the radix tree's nodes move between the tiers (the RadixCache is a TierMoves).

A device node evicted with host room left moves to the host (:meth:`TierMoves.demote_path` for
a retracted request's own KV, ``evict`` for the rest); a host node matched again is promoted
back onto the device top down (:meth:`TierMoves.promote`); host leaves are dropped in LRU order
(:meth:`TierMoves.evict_host`).  The tier manager (``cache/tiers``) owns the slots and the
copies; these methods keep the tree's sizes and heaps right as the slots change hands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.tree_node import DEVICE, HOST, TreeNode

if TYPE_CHECKING:
    from radixserve.cache.eviction import LeafHeap
    from radixserve.cache.kv_events import KVEventRecorder


class TierMoves:
    """The tree's parts these methods use are named here."""

    _evictable: int
    _protected: int
    _host: int
    _host_heap: LeafHeap
    free_slots: Callable[[np.ndarray], None]
    demote: Callable[[TreeNode], np.ndarray | None] | None
    _push_if_evictable: Callable[[TreeNode], None]
    _drop: Callable[[TreeNode], None]
    events: KVEventRecorder

    def _adopt(self, node: TreeNode, device_slots: np.ndarray) -> None:
        """Host ``node`` takes ``device_slots`` (same tokens) and frees its host slots."""
        host_slots, n = node.value, len(node.value)
        self.events.removed(node, HOST)
        self.events.stored(node, DEVICE)
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
        if (
            node.tier != HOST
            or parent is None
            or (parent.parent is not None and parent.tier != DEVICE)
        ):
            raise RuntimeError(f"promote of {node!r}: not a host node below the device part")
        if len(device_slots) != len(node.value):
            raise ValueError(f"promote: {len(device_slots)} slots for {len(node.value)} tokens")
        self._adopt(node, np.asarray(device_slots, dtype=np.int64))
        self._push_if_evictable(node)

    def _to_host(self, node: TreeNode, host_slots: np.ndarray) -> None:
        """Device ``node`` (unlocked) now lives in ``host_slots``; its device slots are freed."""
        n = len(node.value)
        self.events.removed(node, DEVICE)
        self.events.stored(node, HOST)
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
        while freed < num_tokens and (node := self._host_heap.pop()) is not None:
            freed += len(node.value)
            self._drop(node)
        return freed
