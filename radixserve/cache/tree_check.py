"""The radix tree's invariants, recomputed from scratch, and a text dump for debugging."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import numpy as np

from radixserve.cache.tree_node import DEVICE, HOST, ITEM_BYTES, TreeNode

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import RadixCache


def check_tree(tree: RadixCache) -> None:
    """Recompute sizes, locks, keys and the leaf heap; raise RuntimeError on any mismatch."""

    def fail(msg: str) -> NoReturn:
        raise RuntimeError(f"RadixCache invariant violated: {msg}")

    for root in tree._roots.values():
        if (
            root.key_bytes
            or len(root.value)
            or root.lock_ref
            or root.pin_ref
            or root.parent is not None
        ):
            fail("a root must have an empty key, no value, no lock and no parent")
    evictable = protected = pinned = host = 0
    nodes = tree._nodes()
    for node in nodes:
        parent = node.parent
        if parent is None:
            fail(f"{node!r} reachable but has no parent")
        n = len(node.value)
        if n == 0 or n % tree.page_size:
            fail(f"{node!r} has length {n}, not a positive multiple of {tree.page_size}")
        if len(node.key_bytes) != n * ITEM_BYTES or node.value.dtype != np.int64:
            fail(
                f"{node!r} key/value mismatch (key bytes {len(node.key_bytes)}, "
                f"dtype {node.value.dtype})"
            )
        if parent.children.get(tree.child_key(node.key_bytes, 0)) is not node:
            fail(f"{node!r} is not stored under its first page in its parent")
        if node.lock_ref < 0 or not 0 <= node.pin_ref <= node.lock_ref:
            fail(f"{node!r} has a negative lock_ref or pin_ref, or more pins than locks")
        if parent.parent is not None and (
            parent.lock_ref < node.lock_ref or parent.pin_ref < node.pin_ref
        ):
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
    if (evictable, protected) != (tree._evictable, tree._protected):
        fail(
            f"sizes: tracked evictable={tree._evictable} protected={tree._protected}, "
            f"recomputed evictable={evictable} protected={protected}"
        )
    if pinned != tree._pinned:
        fail(f"pinned size: tracked {tree._pinned}, recomputed {pinned}")
    if host != tree._host:
        fail(f"host size: tracked {tree._host}, recomputed {host}")
    if len(nodes) != tree._num_nodes:
        fail(f"tracked {tree._num_nodes} nodes, found {len(nodes)}")
    for tier in (DEVICE, HOST):
        slots = tree.all_slots(tier)
        if len(np.unique(slots)) != len(slots):
            fail(f"a {tier} slot is held by two tree positions")
    in_heap = tree._heap.live_ids()
    in_host_heap = tree._host_heap.live_ids()
    for node in nodes:
        if node.lock_ref:
            continue
        if node.tier == DEVICE and not node.has_device_child() and node.id not in in_heap:
            fail(f"evictable device leaf {node!r} has no valid heap entry")
        if node.tier == HOST and not node.children and node.id not in in_host_heap:
            fail(f"host leaf {node!r} has no valid heap entry")

def tree_text(tree: RadixCache, max_tokens: int = 8) -> str:
    """Indented dump of the tree for debugging."""
    lines = [f"root (evictable={tree._evictable}, protected={tree._protected})"]

    def visit(node: TreeNode, depth: int) -> None:
        for child in node.children.values():
            toks = child.key[:max_tokens].tolist()
            more = "..." if len(child) > max_tokens else ""
            lines.append(
                f"{'  ' * depth}{toks}{more} len={len(child)} {child.tier} "
                f"lock={child.lock_ref} t={child.last_access}"
            )
            visit(child, depth + 1)

    for namespace, root in tree._roots.items():
        if namespace:
            lines.append(f"  namespace {namespace!r}")
        visit(root, 2 if namespace else 1)
    return "\n".join(lines)
