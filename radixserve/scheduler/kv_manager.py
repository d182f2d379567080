"""Glue between requests, the page allocator, the request-to-token table and the radix tree.

The only code that moves slots between owners.  Owners of a page: the allocator (free), the
tree (cached, maybe locked), or exactly one request (``[cached_len, allocated_len)`` of its row).
With tiers it asks the tier manager (``cache/tiers``) to promote host nodes a request matched,
swap a retracted request out, write the blocks that enter the tree to disk and load a waiting
request's stored blocks: the moves are the tier manager's, the requests are the KV manager's.
"""

from __future__ import annotations

import logging

import numpy as np

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.radix_tree import RadixCache
from radixserve.cache.req_to_token import ReqToTokenPool
from radixserve.cache.tiers import ReqTiers, TierManager
from radixserve.cache.tree_check import check_tree
from radixserve.cache.tree_view import divergence
from radixserve.scheduler.request import Req

logger = logging.getLogger(__name__)


class KVManager:
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, tree: RadixCache,
                 tiers: TierManager | None = None, swap: bool = False) -> None:
        self.allocator = allocator
        self.req_pool = req_pool
        self.tree = tree
        self.page_size = allocator.page_size
        self.evicted_tokens = 0
        self.tiers = tiers
        self.host = tiers is not None and tiers.host_pool is not None
        self.disk = tiers.disk if tiers is not None and not tree.disable else None
        self.swap = swap and self.host  # preemption by swapping the KV out to the host tier
        if tiers is not None:
            tiers.attach_device(allocator, self.evict_pages)

    # ---- capacity ----------------------------------------------------------------------
    def aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def available_pages(self) -> int:
        """Pages obtainable now: free ones plus unlocked tree pages that eviction could take."""
        return self.allocator.num_free_pages + self.tree.evictable_size() // self.page_size

    def new_pages_needed(self, req: Req, n: int) -> int:
        """Pages to allocate so that the row covers ``[0, computed_len + n)``."""
        return max(
            0, self.pages_for(req.kv.computed_len + n) - self.pages_for(req.kv.allocated_len)
        )

    def evict_pages(self, n_pages: int) -> None:
        if n_pages > 0:
            self.evicted_tokens += self.tree.evict(n_pages * self.page_size)

    # ---- admission ---------------------------------------------------------------------
    def match_limit(self, req: Req) -> int:
        """How many leading tokens of ``fill_ids`` the request may take from the tree.

        All but the last (the forward must compute at least one token to sample from).  A
        request that still owes prompt logprobs stops at the first position whose logits it
        needs (``PromptLogprobs.next_pos``, i.e. ``logprob_start_len - 1`` before any chunk
        ran): cached tokens have K/V but no logits, so those are recomputed (SGLang does the
        same).  The tree rounds the match down to a page boundary.
        """
        limit = req.fill_len - 1
        state = req.prompt_logprobs
        if state is not None and state.pending:
            limit = min(limit, state.next_pos)
        return limit

    def match(self, req: Req) -> tuple[np.ndarray, object]:
        """Longest cached prefix of ``fill_ids[:match_limit(req)]`` (page aligned)."""
        result = self.tree.match_prefix(req.tokens(0, self.match_limit(req)), req.namespace)
        return result.slots, result.node

    def admit(self, req: Req, page_budget: int | None = None) -> bool:
        """Give the request a row and its cached prefix (locked). False if no row is free.

        A prefix that continues in host nodes is promoted to the device first, as far as
        ``page_budget`` device pages allow (all of it when None).
        """
        row = self.req_pool.alloc()
        if row is None:
            return False
        result = self.tree.match_prefix(req.tokens(0, self.match_limit(req)), req.namespace)
        deepest = result.host_nodes[-1] if result.host_nodes else result.node
        # Where the match stopped matters for a near-miss (a match that split a cached run) or
        # a report asked for.  An earlier attempt to admit the request may have made the split.
        split = self.tree.split_by_last_walk
        if req.hit.tokens is None and (split or req.return_cache_report):
            position = len(result.slots) + result.host_len
            earlier = req.hit.divergence
            inside = split or (
                earlier is not None and earlier.inside_run and earlier.position == position
            )
            req.hit.divergence = divergence(deepest, position, req.tokens(0), inside)
        slots, node, promoted = result.slots, result.node, 0
        if result.host_nodes:
            assert self.tiers is not None
            slots, node, promoted = self.tiers.promote_prefix(
                result.slots, result.node, result.host_nodes, page_budget
            )
        n = len(slots)
        disk = min(req.kv.tiers.disk_tokens, n) if req.kv.tiers is not None else 0
        host = max(0, promoted - disk)
        req.hit.split = {"device": n - disk - host, "host": host, "disk": disk}
        req.kv.row = row
        # Row [0, n): tree slots of the cached prefix.
        if n:
            self.req_pool.write(row, 0, slots)
        req.kv.computed_len = req.kv.cached_len = req.kv.allocated_len = n
        req.kv.last_node = node
        self.tree.inc_lock_ref(node)
        # a retracted request re-reading its own prefix is no hit
        if n and req.num_retractions == 0:
            self.tree.record_hit(node)
        return True

    def ensure_slots(self, req: Req, n: int) -> bool:
        """Back row ``[computed_len, computed_len + n)`` with slots, evicting tree leaves if
        needed."""
        return self.ensure_slots_many([req], [n])

    def ensure_slots_many(self, reqs: list[Req], ns: list[int]) -> bool:
        """Back each request's row ``[computed_len, computed_len + n)`` with slots: one
        allocation and one table write for all of them (a decode step's 64 requests cost one
        call, not 64).
        False, with nothing allocated, when the pool cannot supply them even after eviction."""
        grow = [(req, pages) for req, n in zip(reqs, ns, strict=True)
                if (pages := self.new_pages_needed(req, n))]
        if not grow:
            return True
        total = sum(pages for _, pages in grow)
        short = total - self.allocator.num_free_pages
        if short > 0:
            self.evict_pages(short)
        slots = self.allocator.alloc_pages(total)
        if slots is None:
            return False
        ps = self.page_size
        rows = np.empty(len(grow), dtype=np.int64)
        starts = np.empty(len(grow), dtype=np.int64)
        counts = np.empty(len(grow), dtype=np.int64)
        for i, (req, pages) in enumerate(grow):
            # Row [allocated_len, allocated_len + pages * page_size): the request's new pages.
            rows[i], starts[i], counts[i] = (
                req.kv.row,
                self.pages_for(req.kv.allocated_len) * ps,
                pages * ps,
            )
            req.kv.allocated_len = int(starts[i] + counts[i])
        self.req_pool.write_runs(rows, starts, counts, slots)
        return True

    def trim(self, req: Req) -> None:
        """After a speculative verify: free the request's whole pages past ``fill_len``.

        Row ``[keep, allocated_len)``, ``keep`` the end of the page holding ``fill_len - 1``:
        slots of rejected drafts, freed; ``[computed_len, keep)`` stays allocated (the next
        token's slot, and the rest of its page)."""
        keep = max(self.pages_for(req.fill_len) * self.page_size, req.kv.cached_len)
        if req.kv.allocated_len > keep:
            self.allocator.free_slots(self.req_pool.read(req.kv.row, keep, req.kv.allocated_len))
            req.kv.allocated_len = keep

    # ---- giving KV to the tree ---------------------------------------------------------
    def _insert(self, req: Req) -> int:
        """Insert the computed tokens ``fill_ids[:computed_len]``; free our duplicates of tree
        pages.

        Returns the page-aligned length now held by the tree.  Row regions afterwards:
        ``[cached_len, present)`` were duplicates of tree pages: freed here;
        ``[present, aligned)`` now belong to the tree; ``[aligned, allocated_len)`` stay ours.
        """
        aligned = self.aligned(req.kv.computed_len)
        if self.tree.disable or aligned <= req.kv.cached_len:
            return req.kv.cached_len
        row_slots = self.req_pool.read(req.kv.row, 0, req.kv.computed_len)
        if self.disk is not None:
            assert self.tiers is not None
            state = req.kv.tiers = req.kv.tiers or ReqTiers()
            self.tiers.write_through(
                state, req.tokens(0, req.kv.computed_len), req.namespace, row_slots
            )
        present = self.tree.insert(req.tokens(0, req.kv.computed_len), row_slots, req.namespace)
        if present > req.kv.cached_len:
            self.allocator.free_slots(row_slots[req.kv.cached_len : present])
        return aligned

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: share the computed prefix, keep decoding on tree slots."""
        aligned = self._insert(req)
        if aligned == req.kv.cached_len:
            return
        result = self.tree.match_prefix(req.tokens(0, aligned), req.namespace)
        if len(result.slots) != aligned:
            raise RuntimeError(f"tree lost a just-inserted prefix of {req!r}")
        # Row [0, aligned): the tree's slots (ours in [cached_len, present) were just freed).
        self.req_pool.write(req.kv.row, 0, result.slots)
        self.tree.inc_lock_ref(result.node)
        self.tree.dec_lock_ref(req.kv.last_node)
        req.kv.last_node = result.node
        req.kv.cached_len = aligned

    def release(self, req: Req, cache: bool, swap: bool = False) -> None:
        """Free the request's row and pages; with ``cache`` its computed KV goes to the tree,
        and with ``swap`` (a retraction under ``--preemption-mode swap``) on to the host tier
        at once: the part no other request holds leaves the device now.

        An aborted request is released with ``cache=False``: partial KV never enters the tree.
        """
        if req.kv.row is None:
            return
        keep_until = self._insert(req) if cache else req.kv.cached_len
        tokens = req.tokens(0, keep_until) if swap and self.swap and keep_until > 0 else None
        # Row [keep_until, allocated_len): pages still ours after the insert; free them.
        if req.kv.allocated_len > keep_until:
            tail = self.req_pool.read(req.kv.row, keep_until, req.kv.allocated_len)
            self.allocator.free_slots(tail)
        self.tree.dec_lock_ref(req.kv.last_node)
        self.req_pool.free(req.kv.row)
        req.kv.row = None
        req.kv.last_node = None
        req.kv.computed_len = req.kv.cached_len = req.kv.allocated_len = 0
        if tokens is not None:  # the part no other request holds leaves the device now
            assert self.tiers is not None
            held = self.tiers.swap_out(self.tree.match_prefix(tokens, req.namespace).node)
            if held is not None:  # held for it until it is back (or aborted)
                req.kv.swap_hold = held

    def drop_swap_hold(self, req: Req) -> None:
        if req.kv.swap_hold is not None:
            self.tree.dec_lock_ref(req.kv.swap_hold)
            req.kv.swap_hold = None

    def forget_waiting(self, req: Req) -> None:
        """An aborted waiting request: let go of its swapped-out KV and of its disk load (the
        blocks are dropped on arrival)."""
        self.drop_swap_hold(req)
        if self.tiers is not None:
            self.tiers.forget_load(req.kv.tiers)

    # ---- the disk tier: a waiting request's stored blocks --------------------------------
    def prefetch(self, req: Req) -> None:
        """A request starts to wait: load the blocks of its prefix the disk has (see
        ``TierManager.prefetch``)."""
        if self.disk is None or self.tiers is None:
            return
        state = req.kv.tiers = req.kv.tiers or ReqTiers()
        self.tiers.prefetch(state, req.tokens(0, self.match_limit(req)), req.namespace)

    @staticmethod
    def loading(req: Req) -> bool:
        """Its prefix is coming from disk: it waits."""
        return TierManager.loading(req.kv.tiers)

    def land_loads(self, waiting: list[Req]) -> None:
        """Put the blocks of finished disk loads into the tree and let their requests be
        admitted; a request's prefix that landed on the host is held for it."""
        for req in waiting:
            state = req.kv.tiers
            if state is None or state.load is None or not state.load.future.done():
                continue
            assert self.tiers is not None
            held = self.tiers.land(
                state, req.tokens(0), req.namespace, hold=req.kv.swap_hold is None
            )
            if held is not None:
                req.kv.swap_hold = held

    # ---- checks ------------------------------------------------------------------------
    def owned_pages(self, reqs: list[Req]) -> int:
        return sum(
            (r.kv.allocated_len - r.kv.cached_len) // self.page_size
            for r in reqs
            if r.kv.row is not None
        )

    def check_invariant(self, reqs: list[Req], idle: bool) -> dict[str, int]:
        """free + tree + requests == all pages; no lock left when idle. Raises on violation."""
        check_tree(self.tree)
        free = self.allocator.num_free_pages
        tree_pages = self.tree.total_size() // self.page_size
        req_pages = self.owned_pages(reqs)
        total = self.allocator.num_pages
        report = {
            "free_pages": free,
            "tree_pages": tree_pages,
            "request_pages": req_pages,
            "total_pages": total,
            # held by requests
            "locked_tokens": self.tree.protected_size() - self.tree.pinned_size(),
            "pinned_tokens": self.tree.pinned_size(),
        }
        if free + tree_pages + req_pages != total:
            raise RuntimeError(f"KV page leak: {report}")
        if idle and self.tree.protected_size() != self.tree.pinned_size():
            raise RuntimeError(f"tree locks left while idle: {report}")
        if idle and self.req_pool.num_free != self.req_pool.max_requests:
            raise RuntimeError("request rows left allocated while idle")
        if self.tiers is not None:
            report.update(self.tiers.check())
            report["host_tokens_cached"] = self.tree.host_size()
        return report
