"""Admission: which waiting requests join the next forward, and how many tokens each computes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.radix_tree import RadixCache
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.request import Req, ReqState

# A waiting request whose not-yet-cached prefix shares at least this many tokens with a
# request admitted in the same step waits one step, then reads that prefix from the tree
# instead of computing it a second time (a burst of calls with one system prompt).  A
# request whose whole prompt is shared that way (n > 1, identical prompts) waits whatever
# its length; see ``PrefillAdder.shares_uncached_prefix``.
IN_BATCH_SHARE_THRESHOLD = 32
# Future decode tokens reserved per request are capped, so one request asking for a huge
# max_new_tokens does not block admission.
RESERVE_CLIP_TOKENS = 4096


@dataclass
class PrefillPlan:
    entries: list[tuple[Req, int]] = field(default_factory=list)  # (request, extend_len)
    deferred: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)


def reserve_tokens(req: Req, new_token_ratio: float) -> int:
    """Estimated KV tokens the request will still need for decoding."""
    remaining = max(0, req.params.max_new_tokens - req.output_len)
    return int(min(remaining, RESERVE_CLIP_TOKENS) * new_token_ratio)


class PrefillAdder:
    """Admits work under the token budget and the page budget of one step.

    Page budget = free pages + evictable tree pages - pages reserved for the future decode
    tokens of running (and newly admitted) requests.
    """

    def __init__(
        self,
        kv: KVManager,
        token_budget: int,
        chunk_size: int,
        reserved_tokens: int,
        new_token_ratio: float,
    ) -> None:
        self.kv = kv
        self.token_budget = token_budget
        self.chunk_size = chunk_size  # <= 0: chunking off
        self.reserved_pages = kv.pages_for(reserved_tokens)
        self.new_token_ratio = new_token_ratio
        self.plan = PrefillPlan()
        self.chunked: Req | None = None
        self._in_batch: RadixCache | None = None

    @property
    def remaining(self) -> int:
        return self.token_budget - self.plan.num_tokens

    def _fits(self, req: Req, n: int, reserve: int) -> bool:
        need = self.kv.new_pages_needed(req, n) + self.kv.pages_for(reserve)
        return need <= self.kv.available_pages() - self.reserved_pages

    def _take(self, req: Req, n: int, reserve: int) -> None:
        if not self.kv.ensure_slots(req, n):
            raise RuntimeError(f"page budget said {n} tokens fit for {req!r} but allocation failed")
        self.reserved_pages += self.kv.pages_for(reserve)
        self.plan.entries.append((req, n))
        if n < req.remaining_extend:
            self.chunked = req
        if not self.kv.tree.disable:
            if self._in_batch is None:
                self._in_batch = RadixCache(page_size=1, free_slots=lambda _: None)
            ids = req.tokens(0)
            self._in_batch.insert(ids, np.zeros(len(ids), dtype=np.int64), req.namespace)

    def _chunk_len(self, req: Req) -> int | None:
        """Tokens this request computes now, or None if it must wait for a later step."""
        want = req.remaining_extend
        limit = self.remaining
        if self.chunk_size > 0:
            limit = min(limit, self.chunk_size)
        if want <= limit:
            return want
        if self.chunk_size <= 0:
            # No chunking: a long prompt runs alone rather than never.
            return want if not self.plan.entries else None
        # Chunk ends on a page boundary so the tree can take the computed part.
        n = self.kv.aligned(req.kv.computed_len + limit) - req.kv.computed_len
        return n if n > 0 else None

    def add_chunked(self, req: Req) -> bool:
        """Continue the request whose prompt is being prefilled in chunks."""
        n = self._chunk_len(req)
        if n is None or not self._fits(req, n, reserve_tokens(req, self.new_token_ratio)):
            return False
        self._take(
            req, n, reserve_tokens(req, self.new_token_ratio) if n == req.remaining_extend else 0
        )
        return True

    def shares_uncached_prefix(self, req: Req) -> bool:
        """Whether the request should wait one step to read from the tree what a request
        admitted in this step is computing now.

        Regions of ``fill_ids``: ``[0, cached)`` in the tree already; ``[cached, shared)``
        computed this step by an admitted request (``shared``: the common prefix with it,
        rounded down to a page, as the tree shares whole pages only); ``limit`` =
        ``kv.match_limit(req)``, the most the request may ever take from the tree.  It waits
        when it gains whole pages and either the gain is long (a shared system prompt) or
        ``shared`` reaches ``aligned(limit)``: nothing more could come from the tree (n > 1,
        identical prompts, whatever their length).
        """
        if self._in_batch is None:
            return False
        limit = self.kv.match_limit(req)
        cached = len(self.kv.match(req)[0])
        common = len(self._in_batch.match_prefix(req.tokens(0, limit), req.namespace).slots)
        shared = self.kv.aligned(common)
        gain = shared - cached
        return gain > 0 and (gain >= IN_BATCH_SHARE_THRESHOLD or shared == self.kv.aligned(limit))

    def add_waiting(self, req: Req) -> str:
        """Try to admit a waiting request: 'admitted', 'deferred' (try the next), or 'stop'."""
        if self.chunked is not None or self.remaining <= 0:
            return "stop"
        if self.shares_uncached_prefix(req):
            self.plan.deferred += 1
            return "deferred"
        if not self.kv.admit(req, page_budget=self.kv.available_pages() - self.reserved_pages):
            return "stop"  # no free row in the request-to-token table
        n = self._chunk_len(req)
        reserve = reserve_tokens(req, self.new_token_ratio)
        if n is None or not self._fits(req, n, reserve if n == req.remaining_extend else 0):
            self.kv.release(req, cache=False)
            return "stop"
        if req.hit.tokens is None:
            req.hit.tokens = req.kv.cached_len
            req.hit.by_tier = req.hit.split if self.kv.tiers is not None else None
        req.state = ReqState.PREFILLING
        self.kv.drop_swap_hold(req)  # its own lock holds the prefix now
        self._take(req, n, reserve if n == req.remaining_extend else 0)
        return "admitted"
