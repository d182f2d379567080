"""Glue between requests, the page allocator, the request-to-token table and the radix tree.

The only code that moves slots between owners.  Owners of a page: the allocator (free), the
tree (cached, maybe locked), or exactly one request (``[tree_len, alloc_len)`` of its row).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.radix_tree import RadixCache
from radixserve.cache.req_to_token import ReqToTokenPool
from radixserve.scheduler.request import Req


class KVManager:
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, tree: RadixCache) -> None:
        self.allocator = allocator
        self.req_pool = req_pool
        self.tree = tree
        self.page_size = allocator.page_size
        self.evicted_tokens = 0

    # ---- capacity ----------------------------------------------------------------------
    def aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def available_pages(self) -> int:
        """Pages obtainable now: free ones plus unlocked tree pages that eviction could take."""
        return self.allocator.num_free_pages + self.tree.evictable_size() // self.page_size

    def new_pages_needed(self, req: Req, n: int) -> int:
        """Pages to allocate so that the row covers ``[0, kv_len + n)``."""
        return max(0, self.pages_for(req.kv_len + n) - self.pages_for(req.alloc_len))

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
        result = self.tree.match_prefix(req.tokens(0, self.match_limit(req)), req.extra_key)
        return result.slots, result.node

    def admit(self, req: Req) -> bool:
        """Give the request a row and its cached prefix (locked). False if no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        slots, node = self.match(req)
        n = len(slots)
        req.row = row
        # Row [0, n): tree slots of the cached prefix.
        if n:
            self.req_pool.table[row, :n] = torch.from_numpy(slots)
        req.kv_len = req.tree_len = req.alloc_len = n
        req.last_node = node
        self.tree.inc_lock_ref(node)
        if n and req.num_retractions == 0:  # a retracted request re-reading its own prefix is no hit
            self.tree.record_hit(node)
        return True

    def ensure_slots(self, req: Req, n: int) -> bool:
        """Back row ``[kv_len, kv_len + n)`` with slots, evicting tree leaves if needed."""
        return self.ensure_slots_many([req], [n])

    def ensure_slots_many(self, reqs: list[Req], ns: list[int]) -> bool:
        """Back each request's row ``[kv_len, kv_len + n)`` with slots: one allocation and one
        table write for all of them (a decode step's 64 requests cost one call, not 64).
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
            # Row [alloc_len, alloc_len + pages * page_size): the request's new pages.
            rows[i], starts[i], counts[i] = req.row, self.pages_for(req.alloc_len) * ps, pages * ps
            req.alloc_len = int(starts[i] + counts[i])
        offsets = np.arange(len(slots), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        cols = np.repeat(starts, counts) + offsets
        table = self.req_pool.table
        table[torch.from_numpy(np.repeat(rows, counts)), torch.from_numpy(cols)] = (
            torch.from_numpy(slots).to(table.dtype))
        return True

    def out_slots(self, req: Req, n: int) -> torch.Tensor:
        """Slots for the next ``n`` tokens: row ``[kv_len, kv_len + n)``."""
        return self.req_pool.table[req.row, req.kv_len : req.kv_len + n]

    # ---- giving KV to the tree ---------------------------------------------------------
    def _insert(self, req: Req) -> int:
        """Insert the computed tokens ``fill_ids[:kv_len]``; free our duplicates of tree pages.

        Returns the page-aligned length now held by the tree.  Row regions afterwards:
        ``[tree_len, present)`` were duplicates of tree pages: freed here;
        ``[present, aligned)`` now belong to the tree; ``[aligned, alloc_len)`` stay ours.
        """
        aligned = self.aligned(req.kv_len)
        if self.tree.disable or aligned <= req.tree_len:
            return req.tree_len
        row_slots = self.req_pool.table[req.row, : req.kv_len].numpy().astype(np.int64)
        present = self.tree.insert(req.tokens(0, req.kv_len), row_slots, req.extra_key)
        if present > req.tree_len:
            self.allocator.free_slots(row_slots[req.tree_len : present])
        return aligned

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: share the computed prefix, keep decoding on tree slots."""
        aligned = self._insert(req)
        if aligned == req.tree_len:
            return
        result = self.tree.match_prefix(req.tokens(0, aligned), req.extra_key)
        if len(result.slots) != aligned:
            raise RuntimeError(f"tree lost a just-inserted prefix of {req!r}")
        # Row [0, aligned): the tree's slots (ours in [tree_len, present) were just freed).
        self.req_pool.table[req.row, :aligned] = torch.from_numpy(result.slots)
        self.tree.inc_lock_ref(result.node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = result.node
        req.tree_len = aligned

    def release(self, req: Req, cache: bool) -> None:
        """Free the request's row and pages; with ``cache`` its computed KV goes to the tree.

        An aborted request is released with ``cache=False``: partial KV never enters the tree.
        """
        if req.row is None:
            return
        keep_until = self._insert(req) if cache else req.tree_len
        # Row [keep_until, alloc_len): pages still ours after the insert; free them.
        if req.alloc_len > keep_until:
            tail = self.req_pool.table[req.row, keep_until : req.alloc_len].numpy().astype(np.int64)
            self.allocator.free_slots(tail)
        self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.row)
        req.row = None
        req.last_node = None
        req.kv_len = req.tree_len = req.alloc_len = 0

    # ---- checks ------------------------------------------------------------------------
    def owned_pages(self, reqs: list[Req]) -> int:
        return sum((r.alloc_len - r.tree_len) // self.page_size for r in reqs if r.row is not None)

    def check_invariant(self, reqs: list[Req], idle: bool) -> dict[str, int]:
        """free + tree + requests == all pages; no lock left when idle. Raises on violation."""
        self.tree.check_invariants()
        free = self.allocator.num_free_pages
        tree_pages = self.tree.total_size() // self.page_size
        req_pages = self.owned_pages(reqs)
        total = self.allocator.num_pages
        report = {
            "free_pages": free,
            "tree_pages": tree_pages,
            "request_pages": req_pages,
            "total_pages": total,
            "locked_tokens": self.tree.protected_size() - self.tree.pinned_size(),  # held by requests
            "pinned_tokens": self.tree.pinned_size(),
        }
        if free + tree_pages + req_pages != total:
            raise RuntimeError(f"KV page leak: {report}")
        if idle and self.tree.protected_size() != self.tree.pinned_size():
            raise RuntimeError(f"tree locks left while idle: {report}")
        if idle and self.req_pool.num_free != self.req_pool.max_requests:
            raise RuntimeError("request rows left allocated while idle")
        return report
