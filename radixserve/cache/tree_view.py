"""The radix tree seen from outside: a summary of its heaviest prefixes (``GET /cache/tree``) and
where a request's match stopped (per-request cache reports, near-miss diagnostics).

Both are computed by the scheduler between steps and carry token ids; the front end decodes
them.  A summary touches every node once (no copies of keys but the few head and tail ids of
the nodes it returns).
"""

from __future__ import annotations

import heapq
import struct
import time
from dataclasses import dataclass
from typing import Any

from radixserve.cache.namespace import split_namespace
from radixserve.cache.radix_tree import RadixCache, TreeNode

_ID_STRUCTS = {k: struct.Struct(f"{k}q") for k in range(1, 64)}
SORTS = ("weight", "tokens")
# One row per prefix (rows are cheaper to build than dicts: the scheduler builds, the front end
# expands).  ``start``: tokens of the prefix before the node's run; ``locks``: running requests.
# ``weight``: tokens x hits of the node's own run; ``subtree_tokens``: tokens held by its subtree.
FIELDS = ("id", "parent", "depth", "start", "tokens", "prefix_tokens", "subtree_tokens", "hits",
          "weight", "last_access_age_s", "locks", "pinned", "tier", "children", "salted",
          "head_ids", "tail_ids", "adapter")
EDGE_IDS = 12  # token ids shown at each end of a node's run
# A request "nearly" hit when its match stopped after at least NEAR_MISS_MIN_MATCHED tokens
# inside a cached sequence that goes on for at least NEAR_MISS_MIN_AFTER more.
NEAR_MISS_MIN_MATCHED = 32
NEAR_MISS_MIN_AFTER = 16


def _ids(key_bytes: bytes, first: int, count: int) -> tuple[int, ...]:
    """``count`` token ids of a packed key from position ``first``."""
    return _ID_STRUCTS[count].unpack_from(key_bytes, 8 * first) if count else ()


def summary_rows(tree: RadixCache, sort: str = "weight", depth: int | None = None, limit: int = 50
                 ) -> dict[str, Any]:
    """The ``limit`` heaviest nodes (each the end of a cached prefix) by ``sort``, at most
    ``depth`` nodes below a root, and the tree's totals."""
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {SORTS}, got {sort!r}")
    # One pass, parents before children: (node, depth, start of its run in the prefix).
    order: list[tuple[TreeNode, int, int, str]] = []
    for namespace, root in tree._roots.items():
        stack = [(child, 1, 0) for child in root.children.values()]
        while stack:
            item = stack.pop()
            node, d, start = item
            order.append((node, d, start, namespace))
            if node.children and (depth is None or d < depth):
                end = start + len(node.value)
                stack.extend([(c, d + 1, end) for c in node.children.values()])
    held: dict[int, int] = {}  # tokens held by each node's subtree (within ``depth``)
    for node, _, _, _ in reversed(order):  # children before parents
        h = held[node.id] = held.get(node.id, 0) + len(node.value)
        parent = node.parent
        if parent is not None and parent.parent is not None:
            held[parent.id] = held.get(parent.id, 0) + h
    if sort == "weight":
        def key(item: tuple[TreeNode, int, int, str]) -> tuple[int, int]:
            node = item[0]
            return len(node.value) * node.hits, held[node.id]
    else:
        def key(item: tuple[TreeNode, int, int, str]) -> tuple[int, int]:
            node = item[0]
            return held[node.id], len(node.value) * node.hits
    now = time.monotonic()
    rows = []
    for node, d, start, namespace in heapq.nlargest(limit, order, key=key):
        n = len(node.value)
        kb = node.key_bytes
        parent = node.parent
        salt, adapter = split_namespace(namespace)
        rows.append(
            (
                node.id,
                parent.id if parent is not None and parent.parent is not None else None,
                d,
                start,
                n,
                start + n,
                held[node.id],
                node.hits,
                n * node.hits,
                max(0.0, now - node.touched),
                node.lock_ref - node.pin_ref,
                node.pin_ref > 0,
                node.tier,
                len(node.children),
                bool(salt),
                _ids(kb, 0, min(n, EDGE_IDS)),
                _ids(kb, n - EDGE_IDS, EDGE_IDS) if n > EDGE_IDS else (),
                adapter,  # the LoRA adapter's name, None: the base model
            )
        )
    return {
        "sort": sort,
        "nodes": len(order),
        "device_tokens": tree.total_size(),
        "host_tokens": tree.host_size(),
        "evictable_tokens": tree.evictable_size(),
        "locked_tokens": tree.protected_size() - tree.pinned_size(),
        "pinned_tokens": tree.pinned_size(),
        "fields": FIELDS,
        "rows": rows,
    }


def expand(view: dict[str, Any]) -> dict[str, Any]:
    """A :func:`summary_rows` answer with one dict per prefix (``prefixes``) instead of rows."""
    out = {k: v for k, v in view.items() if k not in ("fields", "rows")}
    out["prefixes"] = [dict(zip(view["fields"], row, strict=True)) for row in view["rows"]]
    for p in out["prefixes"]:
        p["head_ids"], p["tail_ids"] = list(p["head_ids"]), list(p["tail_ids"])
    return out


def summary(
    tree: RadixCache, sort: str = "weight", depth: int | None = None, limit: int = 50
) -> dict[str, Any]:
    """:func:`summary_rows`, one dict per prefix."""
    return expand(summary_rows(tree, sort, depth, limit))


@dataclass
class Divergence:
    """Where a request's match stopped, and the cached sequence that went on from there."""

    position: int  # tokens matched (every tier)
    before_ids: list[int]  # the request's tokens just before the stop
    request_ids: list[int]  # the request's tokens from the stop
    cached_ids: list[int]  # the longest cached continuation's tokens from the stop
    cached_after: int  # tokens of that continuation
    inside_run: bool  # the stop cut a cached run in two (no branch was there before)

    @property
    def near_miss(self) -> bool:
        """It left a cached sequence where nothing had left it before, after a long match,
        with a long cached remainder: typically a chat history rendered differently this turn
        (a date, whitespace, a stripped reasoning block).  A new question after a shared
        system prompt shows up once too, the first time a request branches there."""
        differs = any(a != b for a, b in zip(self.request_ids, self.cached_ids, strict=False))
        return (self.inside_run and differs and self.position >= NEAR_MISS_MIN_MATCHED
                and self.cached_after >= NEAR_MISS_MIN_AFTER)

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "before_ids": self.before_ids,
            "request_ids": self.request_ids,
            "cached_ids": self.cached_ids,
            "cached_after": self.cached_after,
            "near_miss": self.near_miss,
        }


def divergence(
    node: TreeNode, position: int, tokens: Any, inside_run: bool, show: int = EDGE_IDS
) -> Divergence:
    """The request (``tokens``, all of its ids) matched ``position`` tokens, ending at
    ``node``: its next ids and those of the longest cached sequence below ``node``."""
    cached: list[int] = []
    after = 0
    walk = node
    while walk.children:  # follow the longest run each time
        walk = max(walk.children.values(), key=lambda c: len(c.value))
        if len(cached) < show:
            cached += walk.key[: show - len(cached)].tolist()
        after += len(walk.value)
    return Divergence(
        position,
        [int(t) for t in tokens[max(0, position - show) : position]],
        [int(t) for t in tokens[position : position + show]],
        cached,
        after,
        inside_run,
    )
