"""A request as the scheduler sees it: token ids, sampling settings and its KV bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.namespace import cache_namespace
from radixserve.ipc.messages import Bootstrap, FinishReason, PinResult
from radixserve.speculative.base import SpecState
from radixserve.validation import check_logprob_start_len

if TYPE_CHECKING:
    from concurrent.futures import Future

    from radixserve.cache.radix_tree import TreeNode
    from radixserve.cache.tiers import ReqTiers
    from radixserve.cache.tree_view import Divergence
    from radixserve.grammar import RequestGrammar
    from radixserve.lora.adapter import LoraAdapter
    from radixserve.sampling import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"  # in the queue, holds no KV
    PREFILLING = "prefilling"  # admitted, prompt partly computed (chunked prefill)
    RUNNING = "running"  # prompt computed, decoding one token per step
    FINISHED = "finished"


@dataclass
class KVRow:
    """The request's KV bookkeeping (lengths in tokens, see ``Req``)."""

    row: int | None = None  # its row of the request-to-token table, while it holds KV
    computed_len: int = 0
    cached_len: int = 0
    allocated_len: int = 0
    last_node: TreeNode | None = None  # the tree node that locks ``[0, cached_len)``
    # Its swapped-out KV, or the host nodes a disk load brought for it: locked while it waits.
    swap_hold: TreeNode | None = None
    tiers: ReqTiers | None = None  # disk blocks and loads (cache/tiers)


@dataclass
class CacheHit:
    """What the prefix cache gave the request (``meta_info.cached_tokens``, the cache report)."""

    tokens: int | None = None  # the tree hit at its first admission
    by_tier: dict[str, int] | None = None  # that hit by the tier it came from
    split: dict[str, int] = field(default_factory=dict)  # the split of the latest admission
    divergence: Divergence | None = None  # where its first match stopped (cache/tree_view.py)


@dataclass
class Unsent:
    """What the detokenizer has not been sent yet."""

    sent_len: int = 0  # output tokens already sent
    sent_init: bool = False  # the first output (with the prompt's meta) went out
    logprobs: list[float] = field(default_factory=list)  # of the output tokens not sent yet
    top_logprobs: list[list[list[float]]] = field(default_factory=list)


class Req:
    """One vocabulary of lengths, all in tokens (``cached`` is only ever the tree's part):

    ``fill_ids = prompt_ids + output_ids`` (``prompt_len + output_len = fill_len``): every
    token whose K/V should exist eventually.  The KV bookkeeping is ``kv`` (:class:`KVRow`):
    ``kv.computed_len``: tokens of ``fill_ids`` whose K/V is computed and written in the
    request's row.
    ``kv.cached_len``: tokens at the start of the row whose slots belong to the radix tree
    (locked through ``kv.last_node``); page aligned.
    ``kv.allocated_len``: tokens of the row backed by slots; ``>= computed_len`` (the rest of
    the last page).
    ``out.sent_len``: output tokens sent to the detokenizer.  ``hit.tokens`` (not a length of
    the row): the prompt tokens its first admission found in the cache.

    Row ``req_to_token[kv.row]`` (the KV manager's host table; the device copy only receives):
      ``[0, cached_len)``               tree slots, locked, never freed by the request
      ``[cached_len, allocated_len)``   slots of pages the request owns, freed or given to the tree
      ``[computed_len, allocated_len)`` allocated but not written yet (tail of the last page)
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        extra_key: str = "",
        priority: int = 0,
        lora: LoraAdapter | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        # Set when the request asks for prompt logprobs (executor/prompt_logprobs.py).
        self.prompt_logprobs: PromptLogprobs | None = None
        self.stream = stream
        # The cache namespace (``cache_salt``): prefixes are shared only within one.
        self.extra_key = extra_key
        # Its LoRA adapter (None: the base model), the adapter's slot while it runs, and the
        # tree namespace its prefixes live in: the salt and the adapter together.
        self.lora_name = None if lora is None else lora.name
        self.lora_slot = -1
        self.namespace = cache_namespace(extra_key, None if lora is None else lora.key_name)
        self.priority = priority  # the ``priority`` policy's level (see scheduler/policy.py)
        self.pin = False  # pin the cached prompt when finished (scheduler/pins.py)
        self.pin_ttl: float | None = None
        self.pin_result: PinResult | None = None
        self.output_ids: list[int] = []
        # prompt + output ids in one growable int64 buffer: tree keys and model inputs are
        # views of it (no list concatenation per step); see ``tokens`` / ``append_output``.
        self._tokens = np.empty(max(16, 2 * len(prompt_ids)), dtype=np.int64)
        self._tokens[: len(prompt_ids)] = prompt_ids
        self.state = ReqState.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.perf_counter()
        self.queue_time: float | None = None  # seconds from arrival to first admission
        self.first_token_time: float | None = None  # perf_counter() at the first output token
        self.kv = KVRow()
        self.hit = CacheHit()
        self.return_cache_report = False
        # its KV comes from / goes to another worker (disagg)
        self.bootstrap: Bootstrap | None = None
        self.admit_seq = 0  # order of admission, for retraction (latest first)
        self.out = Unsent()
        self.num_retractions = 0
        # Constrained decoding (scheduler/constraints.py): the grammar's compilation, then
        # the request's matcher once it is compiled.
        self.grammar_future: Future | None = None
        self.grammar: RequestGrammar | None = None
        # Speculative decoding (speculative/): this step's drafts and the counters.
        self.spec: SpecState | None = None

    # ---- lengths -----------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def fill_len(self) -> int:
        return self.prompt_len + self.output_len

    def tokens(self, start: int, end: int | None = None) -> np.ndarray:
        """``fill_ids[start:end]`` as an int64 view (do not keep it across appends)."""
        return self._tokens[start : self.fill_len if end is None else end]

    def _reserve(self, n: int) -> None:
        """Room in the token buffer for ``n`` tokens."""
        if n > len(self._tokens):
            grown = np.empty(max(n, 2 * len(self._tokens)), dtype=np.int64)
            grown[: self.fill_len] = self._tokens[: self.fill_len]
            self._tokens = grown

    def append_output(self, token: int) -> None:
        n = self.fill_len
        self._reserve(n + 1)
        self._tokens[n] = token
        if not self.output_ids:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token)

    def stage_draft(self, draft: list[int]) -> None:
        """Write speculative draft tokens after ``fill_ids`` (``tokens(fill_len, fill_len + k)``
        reads them; they are not output until verified)."""
        n = self.fill_len
        self._reserve(n + len(draft))
        self._tokens[n : n + len(draft)] = draft

    @property
    def remaining_extend(self) -> int:
        """Tokens still to compute before the request can sample (prefill left)."""
        return self.fill_len - self.kv.computed_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, {self.state.value}, prompt={self.prompt_len}, "
            f"out={self.output_len}, computed={self.kv.computed_len}, cached={self.kv.cached_len}, "
            f"allocated={self.kv.allocated_len})"
        )


def num_drafts(req: Req) -> int:
    """Draft tokens staged on a decoding request for this step (0 for any other)."""
    if req.spec is None or req.state != ReqState.RUNNING:
        return 0
    return len(req.spec.draft)


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs, accumulated across prefill chunks.

    ``logprobs[i]`` / ``top[i]`` belong to prompt position ``start + i``; position 0 has no
    logprob (None).  ``next_pos``: the next position whose logits are owed; logits at ``q``
    give the logprob of prompt token ``q + 1``, so the request is done at ``prompt_len - 1``.
    """

    start: int
    prompt_len: int
    top_n: int
    next_pos: int
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list[list[float]] | None] = field(default_factory=list)
    sent: bool = False

    @classmethod
    def for_request(
        cls, return_logprob: bool, logprob_start_len: int, prompt_len: int, top_n: int
    ) -> PromptLogprobs | None:
        """State for a request, or None when it wants no prompt logprobs.

        ``logprob_start_len`` -1 means none; ``prompt_len`` an empty list (nothing owed); a
        value outside ``[-1, prompt_len]`` raises ValueError.  Without ``return_logprob`` no
        logprob is returned at all (SGLang's rule).
        """
        check_logprob_start_len(logprob_start_len, prompt_len)
        if not return_logprob or logprob_start_len < 0:
            return None
        state = cls(logprob_start_len, prompt_len, top_n, next_pos=max(logprob_start_len - 1, 0))
        if logprob_start_len == 0:  # the first prompt token has nothing to be predicted from
            state.logprobs.append(None)
            state.top.append(None)
        return state

    @property
    def pending(self) -> bool:
        """Logits still owed (the prompt's last position is the sampling row, not ours)."""
        return self.next_pos < self.prompt_len - 1
