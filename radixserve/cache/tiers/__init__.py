"""KV tiers below the device pool: a host pool and a disk store.

``DEVICE`` -> ``HOST``: a device leaf the tree evicts is copied to host pages (``demote``) and
stays in the tree as a host node; a match that reaches host nodes promotes them back before
the request runs (``KVManager.admit``).  Host leaves are dropped LRU when the host pool is full.
Swap preemption moves a retracted request's own KV to the host the same way.

Disk: write-through and content addressed (``disk.py``).  Every block of ``block_tokens``
that enters the tree is written by a background thread; a waiting request whose prompt
continues past the tree's match into stored blocks loads them in the background (it waits,
nobody else does), and they enter the tree as host nodes (device nodes without a host pool).

Every slot of a pool is in exactly one place: free, a tree node of that tier, a running
request (device), or a load in flight (host slots are allocated only when a load lands, so
the host pool has no in-flight state; a load in flight holds its tensors and a lock on the
tree path it continues).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.kv_pool import KVPool, copy_slots
from radixserve.cache.radix_tree import RadixCache, TreeNode
from radixserve.cache.tiers.disk import DiskStore, LoadResult, block_names, identity_hash

if TYPE_CHECKING:
    from concurrent.futures import Future

logger = logging.getLogger(__name__)

DISK_BLOCK_MIN_TOKENS = 64  # a disk block is the smallest whole number of pages >= this


@dataclass
class DiskLoad:
    future: Future[LoadResult]
    node: TreeNode  # deepest tree node the blocks continue (locked until the load lands)
    start: int  # index of the first block
    names: list[bytes]
    matched: int  # tokens the tree matched when the load began


@dataclass
class ReqTiers:
    """A request's tier state (``Req.tiers``)."""

    names: list[bytes] = field(default_factory=list)  # its full blocks' names so far
    stored: int = 0  # leading blocks known to be on disk (written or found)
    load: DiskLoad | None = None  # a disk load in flight
    checked: bool = False  # disk looked up since the request last began to wait
    disk_tokens: int = 0  # tokens of its prefix that came from disk


@dataclass
class TierStats:
    demoted_tokens: int = 0  # device -> host (eviction)
    swapped_out_tokens: int = 0  # device -> host (swap preemption)
    promoted_tokens: int = 0  # host -> device
    host_dropped_tokens: int = 0  # host leaves evicted
    disk_loads: int = 0
    disk_loaded_tokens: int = 0
    # Time the step loop spent in one copy between tiers (demotion, promotion, disk blocks
    # landing on the device): the longest, and in all.
    copy_s_max: float = 0.0
    copy_s_total: float = 0.0
    cached_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})


class TierManager:
    def __init__(self, device_pool: KVPool, page_size: int, host_tokens: int, disk_dir: str | None,
                 disk_tokens: int, identity: dict[str, Any]) -> None:
        self.device_pool = device_pool
        self.page_size = page_size
        self.stats = TierStats()
        self.host_pool: KVPool | None = None
        self.host_alloc: PageAllocator | None = None
        self.tree: RadixCache | None = None
        if host_tokens > 0:
            pages = max(1, host_tokens // page_size)
            self.host_alloc = PageAllocator(pages, page_size)
            self.host_pool = KVPool(self.host_alloc.num_slots, device_pool.num_layers, device_pool.num_kv_heads,
                                    device_pool.head_dim, device_pool.dtype, "cpu",
                                    pin_memory=device_pool.device.type == "cuda",
                                    kv_cache_dtype=device_pool.kv_cache_dtype)
        self.block_tokens = -(-DISK_BLOCK_MIN_TOKENS // page_size) * page_size
        self.disk: DiskStore | None = None
        if disk_dir:
            full = dict(identity, block_tokens=self.block_tokens, kv_dtype=str(device_pool.dtype),
                        kv_layout=[device_pool.num_layers, device_pool.num_kv_heads, device_pool.head_dim])
            if device_pool.quantized:  # (the identity of a pool in the model's dtype is unchanged)
                full["kv_cache_dtype"] = device_pool.kv_cache_dtype
            self.seed = identity_hash(full)
            shape = (2, device_pool.num_layers, self.block_tokens, device_pool.slot_bytes)
            self.disk = DiskStore(disk_dir, disk_tokens, self.block_tokens, full, shape)

    @property
    def host_tokens(self) -> int:
        return 0 if self.host_alloc is None else self.host_alloc.num_pages * self.page_size

    def attach(self, tree: RadixCache) -> None:
        self.tree = tree
        if self.host_alloc is not None:
            tree.demote = self.demote
            tree.free_host_slots = self.free_host

    # ---- host tier ---------------------------------------------------------------------
    def demote(self, node: TreeNode) -> np.ndarray | None:
        """Host slots holding a copy of device ``node``'s KV, or None when the host pool
        cannot take it (its unlocked leaves evicted first)."""
        assert self.host_alloc is not None and self.host_pool is not None and self.tree is not None
        pages = len(node.value) // self.page_size
        short = pages - self.host_alloc.num_free_pages
        if short > 0:
            self.stats.host_dropped_tokens += self.tree.evict_host(short * self.page_size)
        slots = self.host_alloc.alloc_pages(pages)
        if slots is None:
            return None
        t0 = time.perf_counter()
        copy_slots(self.device_pool, node.value, self.host_pool, slots)
        self.timed_copy(time.perf_counter() - t0)
        self.stats.demoted_tokens += len(slots)
        return slots

    def free_host(self, slots: np.ndarray) -> None:
        assert self.host_alloc is not None
        self.host_alloc.free_slots(slots)

    def to_device(self, host_slots: np.ndarray, device_slots: np.ndarray) -> None:
        assert self.host_pool is not None
        t0 = time.perf_counter()
        copy_slots(self.host_pool, host_slots, self.device_pool, device_slots)
        self.timed_copy(time.perf_counter() - t0)
        self.stats.promoted_tokens += len(device_slots)

    def timed_copy(self, seconds: float) -> None:
        self.stats.copy_s_total += seconds
        self.stats.copy_s_max = max(self.stats.copy_s_max, seconds)

    def host_pages_free(self) -> int:
        return 0 if self.host_alloc is None else self.host_alloc.num_free_pages

    # ---- disk tier ---------------------------------------------------------------------
    def block_names(self, state: ReqTiers, tokens: np.ndarray, namespace: str) -> list[bytes]:
        """Names of the full blocks of ``tokens`` (a request's ids from position 0)."""
        want = len(tokens) // self.block_tokens
        if len(state.names) < want:
            seed = self.seed + namespace.encode()
            prev = state.names[-1] if state.names else None
            state.names += block_names(tokens[: want * self.block_tokens], self.block_tokens, seed,
                                       len(state.names), prev)
        return state.names[:want]

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        d: dict[str, Any] = {
            "host_tokens": self.host_tokens,
            "host_free_tokens": self.host_pages_free() * self.page_size,
            "demoted_tokens": s.demoted_tokens,
            "swapped_out_tokens": s.swapped_out_tokens,
            "promoted_tokens": s.promoted_tokens,
            "host_dropped_tokens": s.host_dropped_tokens,
            "tier_copy_ms_max": 1000 * s.copy_s_max,
            "tier_copy_ms_total": 1000 * s.copy_s_total,
            "cached_tokens_by_tier": dict(s.cached_tokens),
        }
        if self.disk is not None:
            d.update(disk_blocks=len(self.disk), disk_block_tokens=self.block_tokens,
                     disk_written_blocks=self.disk.written_blocks, disk_loads=s.disk_loads,
                     disk_loaded_tokens=s.disk_loaded_tokens, disk_corrupt_blocks=self.disk.corrupt_blocks)
        return d

    def check(self) -> dict[str, int]:
        """Host slots: free + held by tree nodes == all (raises RuntimeError otherwise)."""
        if self.host_alloc is None or self.tree is None:
            return {}
        held = self.tree.host_size() // self.page_size
        free = self.host_alloc.num_free_pages
        if held + free != self.host_alloc.num_pages:
            raise RuntimeError(f"host page leak: free {free} + tree {held} != {self.host_alloc.num_pages}")
        used = set(self.host_alloc.used_pages().tolist())
        tree_pages = set((self.tree.all_slots("host")[:: self.page_size] // self.page_size).tolist())
        if used != tree_pages:
            raise RuntimeError("host pages in use differ from the host pages the tree holds")
        return {"host_free_pages": free, "host_tree_pages": held}

