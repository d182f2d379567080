"""KV tiers below the device pool: a host pool and a disk store.

``DEVICE`` -> ``HOST``: a device leaf the tree evicts is copied to host pages (``demote``) and
stays in the tree as a host node; a match that reaches host nodes promotes them back before
the request runs (``KVManager.admit``).  Host leaves are dropped LRU when the host pool is full.
Swap preemption moves a retracted request's own KV to the host the same way.

Disk: write-through and content addressed (``disk.py``).  Every block of ``block_tokens``
that enters the tree is written by a background thread; a waiting request whose prompt
continues past the tree's match into stored blocks loads them in the background (it waits,
nobody else does), and they enter the tree as host nodes (device nodes without a host pool).

All tier movement goes through the :class:`TierManager`.  The radix tree calls its hooks when
it evicts a device leaf (``demote``) or drops a host node (``free_host``); the KV manager
calls it to promote a matched prefix (``promote_prefix``), swap a retracted request out
(``swap_out``), write blocks through (``write_through``) and load a waiting request's blocks
(``prefetch``, ``land``).  The device side it needs back (the page allocator, eviction of
device pages) is what the KV manager gives it in :meth:`TierManager.attach`.

Every slot of a pool is in exactly one place: free, a tree node of that tier, a running
request (device), or a load in flight (host slots are allocated only when a load lands, so
the host pool has no in-flight state; a load in flight holds its tensors and a lock on the
tree path it continues).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.kv_events import DISK
from radixserve.cache.kv_pool import KVPool, copy_slots
from radixserve.cache.radix_tree import RadixCache, TreeNode
from radixserve.cache.tiers.disk import DiskStore, block_names, identity_hash
from radixserve.cache.tiers.records import DiskLoad, ReqTiers, TierStats
from radixserve.cache.tree_node import DEVICE, HOST

__all__ = ["DISK_BLOCK_MIN_TOKENS", "DiskLoad", "ReqTiers", "TierManager", "TierStats"]

logger = logging.getLogger(__name__)

DISK_BLOCK_MIN_TOKENS = 64  # a disk block is the smallest whole number of pages >= this


class TierManager:
    def __init__(self, device_pool: KVPool, page_size: int, host_tokens: int, disk_dir: str | None,
                 disk_tokens: int, identity: dict[str, Any]) -> None:
        self.device_pool = device_pool
        self.page_size = page_size
        self.stats = TierStats()
        self.host_pool: KVPool | None = None
        self.host_alloc: PageAllocator | None = None
        self.tree: RadixCache | None = None
        # The device side, given by the KV manager (attach_device).
        self.device_alloc: PageAllocator | None = None
        self.evict_device_pages: Callable[[int], None] | None = None
        if host_tokens > 0:
            pages = max(1, host_tokens // page_size)
            self.host_alloc = PageAllocator(pages, page_size)
            self.host_pool = KVPool(self.host_alloc.num_slots, device_pool.num_layers,
                                    device_pool.num_kv_heads, device_pool.head_dim,
                                    device_pool.dtype, "cpu",
                                    pin_memory=device_pool.device.type == "cuda",
                                    kv_cache_dtype=device_pool.kv_cache_dtype)
        self.block_tokens = -(-DISK_BLOCK_MIN_TOKENS // page_size) * page_size
        self.disk: DiskStore | None = None
        if disk_dir:
            full = dict(identity, block_tokens=self.block_tokens, kv_dtype=str(device_pool.dtype),
                        kv_layout=[device_pool.num_layers, device_pool.num_kv_heads,
                                   device_pool.head_dim])
            if device_pool.quantized:  # (the identity of a pool in the model's dtype is unchanged)
                full["kv_cache_dtype"] = device_pool.kv_cache_dtype
            self.seed = identity_hash(full)
            shape = (2, device_pool.num_layers, self.block_tokens, device_pool.slot_bytes)
            self.disk = DiskStore(disk_dir, disk_tokens, self.block_tokens, full, shape)

    @property
    def host_tokens(self) -> int:
        return 0 if self.host_alloc is None else self.host_alloc.num_pages * self.page_size

    def attach(self, tree: RadixCache) -> None:
        """The tree calls ``demote`` and ``free_host`` as its device leaves leave and its host
        nodes go."""
        self.tree = tree
        if self.host_alloc is not None:
            tree.demote = self.demote
            tree.free_host_slots = self.free_host
        if self.disk is not None and tree.events.enabled:
            self.disk.on_drop = lambda hashes: tree.events.removed_hashes(hashes, DISK)

    def attach_device(self, allocator: PageAllocator, evict_pages: Callable[[int], None]) -> None:
        """The device side (the KV manager's): its page allocator, and eviction of ``n`` device
        pages from the tree (counted by the KV manager)."""
        self.device_alloc = allocator
        self.evict_device_pages = evict_pages

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

    def promote_prefix(self, slots: np.ndarray, node: TreeNode, host_nodes: tuple[TreeNode, ...],
                       page_budget: int | None) -> tuple[np.ndarray, TreeNode, int]:
        """Copy the leading ``host_nodes`` of a match that fit to the device, top down, within
        ``page_budget`` device pages (None: as many as obtainable); return the prefix's device
        slots, its deepest device node and the tokens promoted."""
        assert (self.tree is not None and self.device_alloc is not None
                and self.evict_device_pages is not None)
        obtainable = self.device_alloc.num_free_pages + self.tree.evictable_size() // self.page_size
        reserve = 0 if page_budget is None else max(0, obtainable - page_budget)
        self.tree.inc_lock_ref(host_nodes[-1])  # the path stays put while pages are evicted for it
        budget = (self.device_alloc.num_free_pages + self.tree.evictable_size() // self.page_size
                  - reserve)
        take, pages = [], 0
        for host_node in host_nodes:
            need = len(host_node.value) // self.page_size
            if pages + need > budget:
                break
            take.append(host_node)
            pages += need
        short = pages - self.device_alloc.num_free_pages
        if short > 0:
            self.evict_device_pages(short)
        device = self.device_alloc.alloc_pages(pages) if take else None
        self.tree.dec_lock_ref(host_nodes[-1])
        if not take:
            return slots, node, 0
        if device is None:
            raise RuntimeError(f"promotion of {pages} pages failed within a budget of {budget}")
        self.to_device(np.concatenate([h.value for h in take]), device)
        at = 0
        for host_node in take:
            n = len(host_node.value)
            self.tree.promote(host_node, device[at : at + n])
            at += n
        return np.concatenate([slots, device]), take[-1], at

    def swap_out(self, tip: TreeNode) -> TreeNode | None:
        """A retracted request's own KV, ending at ``tip``, to the host (the part no other
        request holds); return ``tip`` locked when it is on the host now (held for the
        request until it is back), else None."""
        assert self.tree is not None
        self.stats.swapped_out_tokens += self.tree.demote_path(tip)
        if tip.tier == HOST and tip.parent is not None:
            self.tree.inc_lock_ref(tip)
            return tip
        return None

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

    def write_through(self, state: ReqTiers, tokens: np.ndarray, namespace: str,
                      row_slots: np.ndarray) -> None:
        """Store the full blocks of ``tokens`` (a request's computed ids from position 0,
        their KV in ``row_slots``: tree slots and the request's own) that the disk lacks; with
        KV events on, announce the blocks of the prompt the disk holds and has not announced
        (just written, or found there from an earlier run)."""
        assert self.disk is not None
        names = self.block_names(state, tokens, namespace)
        if state.stored < len(names):
            self._write_blocks(names, state.stored, row_slots)
            self.disk.touch(names)
            state.stored = len(names)
        if self.tree is not None and self.tree.events.enabled:
            self._announce(names, tokens, namespace)

    def _write_blocks(self, names: list[bytes], start: int, row_slots: np.ndarray) -> None:
        assert self.disk is not None
        bt = self.block_tokens
        new = [i for i in range(start, len(names)) if names[i] not in self.disk]
        if new:
            slots = np.concatenate([row_slots[i * bt : (i + 1) * bt] for i in new])
            kv = self.device_pool.gather(slots)  # [2, layers, n * bt, slot bytes] uint8
            ready = None
            if kv.is_cuda:  # off the device without waiting: the I/O thread waits for the copy
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                host.copy_(kv, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                kv = host
            self.disk.write([names[i] for i in new],
                            [kv[:, :, j * bt : (j + 1) * bt] for j in range(len(new))], ready)

    def _announce(self, names: list[bytes], tokens: np.ndarray, namespace: str) -> None:
        """KV events for the disk blocks of a prompt (``names``) not announced yet."""
        assert self.disk is not None and self.tree is not None
        todo = [i for i, name in enumerate(names) if self.disk.unannounced(name)]
        if not todo:
            return
        events, bt, per = self.tree.events, self.block_tokens, self.block_tokens // self.page_size
        hashes = events.page_hashes(tokens[: len(names) * bt], namespace)
        for i in todo:
            block = hashes[i * per : (i + 1) * per]
            events.stored_pages(block, hashes[i * per - 1] if i else None,
                                tokens[i * bt : (i + 1) * bt].tolist(), DISK, namespace)
            self.disk.announced(names[i], block)

    def prefetch(self, state: ReqTiers, tokens: np.ndarray, namespace: str) -> None:
        """For a request that starts to wait, ``tokens`` the part of its ids it may take from
        the cache: if they continue past the tree's match into blocks on disk, start loading
        them (the request waits for them: ``loading``)."""
        assert self.disk is not None and self.tree is not None
        if state.checked or state.load is not None:
            return
        state.checked = True
        bt = self.block_tokens
        if len(tokens) < bt:
            return
        result = self.tree.match_prefix(tokens, namespace)
        matched = len(result.slots) + result.host_len
        names = self.block_names(state, tokens, namespace)
        start = matched // bt
        run = self.disk.run_length(names[start:])
        if run == 0 or (start + run) * bt <= matched:
            return
        node = result.host_nodes[-1] if result.host_nodes else result.node
        self.tree.inc_lock_ref(node)
        state.load = DiskLoad(self.disk.load(names[start : start + run]), node, start,
                              names[start : start + run], matched)
        self.stats.disk_loads += 1

    @staticmethod
    def loading(state: ReqTiers | None) -> bool:
        return state is not None and state.load is not None

    def land(self, state: ReqTiers, tokens: np.ndarray, namespace: str,
             hold: bool) -> TreeNode | None:
        """A finished load of ``state``'s: its blocks into the tree (host nodes, or device
        nodes without a host tier).  With ``hold``, return the deepest host node of the
        request's prefix (``tokens``: its ids) locked, held for it until it is admitted as
        swapped-out KV is; else None."""
        assert self.disk is not None and self.tree is not None and state.load is not None
        load, state.load = state.load, None
        try:
            result = load.future.result()
        except Exception:  # an I/O error: the request computes its prompt instead
            logger.exception("disk KV cache: a load failed")
            self.tree.dec_lock_ref(load.node)
            return None
        if result.bad:
            self.disk.forget(result.bad)
        held = None
        if result.blocks:
            end = self._insert_blocks(tokens, namespace, load, result.blocks)
            state.disk_tokens = max(0, end - load.matched)
            if self.tree.events.enabled:  # blocks from an earlier run are known by their tokens now
                self._announce(self.block_names(state, tokens[:end], namespace), tokens, namespace)
            found = (self.tree.match_prefix(tokens[:end], namespace)
                     if self.host_pool is not None else None)
            if hold and found is not None and found.host_nodes:
                held = found.host_nodes[-1]
                self.tree.inc_lock_ref(held)
        self.tree.dec_lock_ref(load.node)
        return held

    def _insert_blocks(self, tokens: np.ndarray, namespace: str, load: DiskLoad,
                       blocks: list[torch.Tensor]) -> int:
        """Insert loaded blocks after ``load.node``; return the end of the cached prefix."""
        assert (self.tree is not None and self.device_alloc is not None
                and self.evict_device_pages is not None)
        bt, ps = self.block_tokens, self.page_size
        begin, end = load.start * bt, (load.start + len(blocks)) * bt
        pages = (end - begin) // ps
        if self.host_alloc is not None and self.host_pool is not None:
            short = pages - self.host_alloc.num_free_pages
            if short > 0:
                self.stats.host_dropped_tokens += self.tree.evict_host(short * ps)
            slots, pool, tier = self.host_alloc.alloc_pages(pages), self.host_pool, HOST
        else:
            short = pages - self.device_alloc.num_free_pages
            if short > 0:
                self.evict_device_pages(short)
            slots, pool, tier = self.device_alloc.alloc_pages(pages), self.device_pool, DEVICE
        if slots is None:
            return load.matched
        t0 = time.perf_counter()
        pool.scatter(slots, torch.cat(blocks, dim=2))
        if tier == DEVICE:
            self.timed_copy(time.perf_counter() - t0)
        keys = np.concatenate([np.full(begin, -1, dtype=np.int64), slots])
        present = self.tree.insert(tokens[:end], keys, namespace, tier=tier)
        dup = slots[: max(0, present - begin)]
        if len(dup):  # the tree had these already (another request computed them meanwhile)
            (self.free_host if tier == HOST else self.device_alloc.free_slots)(dup)
        self.stats.disk_loaded_tokens += end - max(begin, present)
        return end

    def forget_load(self, state: ReqTiers | None) -> None:
        """An aborted waiting request's load: the blocks are dropped when they arrive."""
        if state is not None and state.load is not None:
            assert self.tree is not None
            self.tree.dec_lock_ref(state.load.node)
            state.load = None

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
                     disk_loaded_tokens=s.disk_loaded_tokens,
                     disk_corrupt_blocks=self.disk.corrupt_blocks)
        return d

    def check(self) -> dict[str, int]:
        """Host slots: free + held by tree nodes == all (raises RuntimeError otherwise)."""
        if self.host_alloc is None or self.tree is None:
            return {}
        held = self.tree.host_size() // self.page_size
        free = self.host_alloc.num_free_pages
        if held + free != self.host_alloc.num_pages:
            raise RuntimeError(
                f"host page leak: free {free} + tree {held} != {self.host_alloc.num_pages}")
        used = set(self.host_alloc.used_pages().tolist())
        tree_pages = set(
            (self.tree.all_slots("host")[:: self.page_size] // self.page_size).tolist())
        if used != tree_pages:
            raise RuntimeError("host pages in use differ from the host pages the tree holds")
        return {"host_free_pages": free, "host_tree_pages": held}

