"""The KV manager's disk-tier moves (the KVManager is a DiskTierMoves).

Blocks that enter the tree are written through to disk (on the tier's I/O thread); a waiting
request whose prompt continues past the tree's match into stored blocks loads them first
(``prefetch``; it waits while ``loading``), and ``land_loads`` inserts what arrived into the
tree: as host nodes with a host tier, else as device nodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixserve.cache.tiers import DiskLoad, ReqTiers, TierManager
from radixserve.cache.tree_node import DEVICE, HOST
from radixserve.scheduler.request import Req

if TYPE_CHECKING:
    from radixserve.cache.allocator import PageAllocator
    from radixserve.cache.radix_tree import RadixCache
    from radixserve.cache.tiers.disk import DiskStore

logger = logging.getLogger(__name__)


class DiskTierMoves:
    """The KV manager's parts these methods use are named here."""

    allocator: PageAllocator
    tree: RadixCache
    tiers: TierManager | None
    disk: DiskStore | None
    host: bool
    page_size: int
    match_limit: Callable[[Req], int]
    evict_pages: Callable[[int], None]

    def _write_through(self, req: Req, row_slots: np.ndarray) -> None:
        """Store the request's full blocks in ``[0, computed_len)`` that the disk lacks (their KV is
        in the row: tree slots and the request's own)."""
        assert self.tiers is not None and self.disk is not None
        state = req.kv.tiers = req.kv.tiers or ReqTiers()
        names = self.tiers.block_names(state, req.tokens(0, req.kv.computed_len), req.extra_key)
        if state.stored >= len(names):
            return
        bt = self.tiers.block_tokens
        new = [i for i in range(state.stored, len(names)) if names[i] not in self.disk]
        if new:
            slots = np.concatenate([row_slots[i * bt : (i + 1) * bt] for i in new])
            kv = self.tiers.device_pool.gather(slots)  # [2, layers, n * bt, slot bytes] uint8
            ready = None
            if kv.is_cuda:  # off the device without waiting: the I/O thread waits for the copy
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                host.copy_(kv, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                kv = host
            self.disk.write([names[i] for i in new], [kv[:, :, j * bt : (j + 1) * bt] for j in range(len(new))],
                            ready)
        self.disk.touch(names)
        state.stored = len(names)

    def prefetch(self, req: Req) -> None:
        """For a request that starts to wait: if its prompt continues past the tree's match
        into blocks on disk, start loading them (the request waits for them: ``loading``)."""
        if self.disk is None or self.tiers is None:
            return
        state = req.kv.tiers = req.kv.tiers or ReqTiers()
        if state.checked or state.load is not None:
            return
        state.checked = True
        limit = self.match_limit(req)
        bt = self.tiers.block_tokens
        if limit < bt:
            return
        result = self.tree.match_prefix(req.tokens(0, limit), req.extra_key)
        matched = len(result.slots) + result.host_len
        names = self.tiers.block_names(state, req.tokens(0, limit), req.extra_key)
        start = matched // bt
        run = self.disk.run_length(names[start:])
        if run == 0 or (start + run) * bt <= matched:
            return
        node = result.host_nodes[-1] if result.host_nodes else result.node
        self.tree.inc_lock_ref(node)
        state.load = DiskLoad(self.disk.load(names[start : start + run]), node, start,
                              names[start : start + run], matched)
        self.tiers.stats.disk_loads += 1

    @staticmethod
    def loading(req: Req) -> bool:
        return req.kv.tiers is not None and req.kv.tiers.load is not None

    def land_loads(self, waiting: list[Req]) -> None:
        """Put the blocks of finished disk loads into the tree (host nodes, or device nodes
        without a host tier) and let their requests be admitted."""
        for req in waiting:
            state = req.kv.tiers
            if state is None or state.load is None or not state.load.future.done():
                continue
            load, state.load = state.load, None
            try:
                result = load.future.result()
            except Exception:  # an I/O error: the request computes its prompt instead
                logger.exception("disk KV cache: a load failed")
                self.tree.dec_lock_ref(load.node)
                continue
            assert self.disk is not None
            if result.bad:
                self.disk.forget(result.bad)
            if result.blocks:
                end = self._insert_blocks(req, load, result.blocks)
                state.disk_tokens = max(0, end - load.matched)
                found = self.tree.match_prefix(req.tokens(0, end), req.extra_key) if self.host else None
                if found is not None and found.host_nodes and req.kv.swap_hold is None:
                    # Held for the request on the host until it is admitted, as swapped-out KV is.
                    req.kv.swap_hold = found.host_nodes[-1]
                    self.tree.inc_lock_ref(req.kv.swap_hold)
            self.tree.dec_lock_ref(load.node)

    def _insert_blocks(self, req: Req, load: DiskLoad, blocks: list[torch.Tensor]) -> int:
        """Insert loaded blocks after ``load.node``; return the end of the cached prefix."""
        assert self.tiers is not None
        bt, ps = self.tiers.block_tokens, self.page_size
        begin, end = load.start * bt, (load.start + len(blocks)) * bt
        pages = (end - begin) // ps
        if self.host:
            assert self.tiers.host_alloc is not None and self.tiers.host_pool is not None
            short = pages - self.tiers.host_alloc.num_free_pages
            if short > 0:
                self.tiers.stats.host_dropped_tokens += self.tree.evict_host(short * ps)
            slots, pool, tier = self.tiers.host_alloc.alloc_pages(pages), self.tiers.host_pool, HOST
        else:
            short = pages - self.allocator.num_free_pages
            if short > 0:
                self.evict_pages(short)
            slots, pool, tier = self.allocator.alloc_pages(pages), self.tiers.device_pool, DEVICE
        if slots is None:
            return load.matched
        t0 = time.perf_counter()
        pool.scatter(slots, torch.cat(blocks, dim=2))
        if tier == DEVICE:
            self.tiers.timed_copy(time.perf_counter() - t0)
        keys = np.concatenate([np.full(begin, -1, dtype=np.int64), slots])
        present = self.tree.insert(req.tokens(0, end), keys, req.extra_key, tier=tier)
        dup = slots[: max(0, present - begin)]
        if len(dup):  # the tree had these already (another request computed them meanwhile)
            (self.tiers.free_host if tier == HOST else self.allocator.free_slots)(dup)
        self.tiers.stats.disk_loaded_tokens += end - max(begin, present)
        return end
