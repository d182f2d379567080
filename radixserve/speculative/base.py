"""The proposer interface of speculative decoding, and the per-request state every algorithm shares.

A proposer stages draft tokens on the decoding requests before a forward; the scheduler's
forward verifies them (a request with ``k`` drafts samples ``k + 1`` rows), and the proposer
counts what was kept.  One step, as the scheduler drives it:
  1. ``propose(decodes, kv, context_len)``: drafts staged after each request's ``fill_ids``
     (``req.spec.draft``) and backed by KV slots; every decoding request gets a SpecState.
  2. the forward, then per sampling request ``accept(req, sampled)``: how many drafts the
     sampled tokens confirm;
  3. ``record(req, kept)``: the drafts that became output, counted; the draft cleared.
``stats()`` reports the counters (``get_stats``, ``/server_info``, ``/metrics``).

The scheduler owns its requests and its KV manager and sits above this package, so the few
fields a proposer uses are named here as protocols (``scheduler/request.py``'s ``Req`` and
``scheduler/kv_manager.py``'s ``KVManager`` satisfy them as they are).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from radixserve.cache.allocator import PageAllocator
    from radixserve.cache.radix_tree import TreeNode
    from radixserve.config import ServerArgs
    from radixserve.grammar import RequestGrammar
    from radixserve.sampling import SamplingParams


@dataclass
class SpecState:
    """A request's speculative decoding: the drafts of the current step and its counters."""

    draft: list[int] = field(default_factory=list)  # staged after fill_ids, verified this step
    verify_ct: int = 0  # decode steps that verified (with or without drafts)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    def meta(self, completion_tokens: int) -> dict[str, float | int]:
        """SGLang's ``meta_info`` fields (``spec_accept_length``: tokens per verify step)."""
        if not self.verify_ct:
            return {}
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": completion_tokens / self.verify_ct,
            "spec_accept_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_num_proposed_drafts": self.proposed,
            "spec_num_correct_drafts": self.accepted,
        }


class DraftRowView(Protocol):
    """A request's place in the radix tree: ``[0, cached_len)`` of its row is the tree's,
    locked through ``last_node``."""

    @property
    def last_node(self) -> TreeNode | None: ...

    @property
    def cached_len(self) -> int: ...


class DraftReqView(Protocol):
    """A decoding request as a proposer sees it: its tokens, its room, its grammar."""

    spec: SpecState | None
    params: SamplingParams
    grammar: RequestGrammar | None
    admit_seq: int  # order of admission: the latest admitted go without drafts first

    @property
    def kv(self) -> DraftRowView: ...

    @property
    def output_len(self) -> int: ...

    @property
    def fill_len(self) -> int: ...

    @property
    def remaining_extend(self) -> int:
        """Tokens to compute before the request samples (its pending tokens, without drafts)."""

    def tokens(self, start: int, end: int | None = None) -> np.ndarray:
        """``fill_ids[start:end]`` as an int64 view."""

    def stage_draft(self, draft: list[int]) -> None:
        """Write the drafts after ``fill_ids`` (not output until verified)."""


class DraftSlots(Protocol):
    """The KV manager as a proposer uses it: the page size, the free pages, and slots for a
    request's next ``n`` tokens."""

    @property
    def page_size(self) -> int: ...

    @property
    def allocator(self) -> PageAllocator: ...

    def new_pages_needed(self, req: DraftReqView, n: int) -> int:
        """Pages the request must add to back its next ``n`` tokens."""

    def ensure_slots_many(self, reqs: list[DraftReqView], ns: list[int]) -> bool:
        """Back each request's next ``ns[i]`` tokens with slots; False (nothing taken) when
        the pages are not there."""


class Proposer(ABC):
    """One speculative algorithm: drafts for a batch, their acceptance, the counters.

    A new algorithm is a subclass in its own file, registered by name in ``registry.py``.
    ``accept`` and ``record`` are the rule for deterministic drafts (a draft is accepted while
    it equals the token sampled before it); an algorithm with another rule overrides them.
    """

    # A step of a server with this proposer can carry drafts (several rows of one request in
    # a decode), so a one-row step must compute what those rows compute: the quantized weights'
    # one-row kernel choice reads it (``registry.steps_carry_drafts``).
    carries_drafts: ClassVar[bool] = True

    def __init__(self) -> None:
        # Counters for the scheduler's stats (SGLang's spec_accept_length: tokens per verify).
        self.verify_steps = 0
        self.proposed = 0
        self.accepted = 0

    @classmethod
    @abstractmethod
    def from_args(cls, args: ServerArgs) -> Proposer:
        """The proposer the server's settings describe."""

    @abstractmethod
    def propose(self, decodes: Sequence[DraftReqView], kv: DraftSlots, context_len: int) -> int:
        """Stage drafts on the decoding requests and back them with free slots; return the
        number of draft tokens staged.  Every decoding request gets a SpecState (a verify)."""

    def accept(self, req: DraftReqView, sampled: list[int]) -> int:
        """How many of the request's drafts the sampled tokens ``[k + 1]`` confirm."""
        assert req.spec is not None  # the scheduler asks only requests it proposed for
        draft = req.spec.draft
        accepted = 0
        while accepted < len(draft) and sampled[accepted] == draft[accepted]:
            accepted += 1
        return accepted

    def record(self, req: DraftReqView, accepted: int) -> None:
        """Count a verify of the request that kept ``accepted`` drafts; clear its drafts."""
        spec = req.spec
        assert spec is not None  # the scheduler records only requests it proposed for
        spec.verify_ct += 1
        spec.proposed += len(spec.draft)
        spec.accepted += accepted
        self.verify_steps += 1
        self.proposed += len(spec.draft)
        self.accepted += accepted
        spec.draft = []

    def stats(self) -> dict[str, float | int]:
        """The ``spec_*`` counters since start (SGLang's names)."""
        steps, proposed, accepted = self.verify_steps, self.proposed, self.accepted
        return {
            "spec_verify_steps": steps,
            "spec_draft_tokens": proposed,
            "spec_accepted_tokens": accepted,
            "spec_accept_length": (steps + accepted) / steps if steps else 0.0,
            "spec_accept_rate": accepted / proposed if proposed else 0.0,
        }
