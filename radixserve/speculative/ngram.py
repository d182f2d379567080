"""N-gram speculative decoding (``--speculative-algorithm ngram``): drafts without a draft model.

Before each forward, every decoding request (while at most
``--speculative-disable-by-batch-size`` run) gets up to ``--speculative-num-draft-tokens - 1``
draft tokens, from the first source that has some:
  1. the radix tree: text another request already computed after this request's exact token
     sequence (a retried or regenerated prompt, parallel samples of one prompt, the branches
     of a program), found by walking down from the node that holds the request's prefix;
  2. its own prompt and output: the latest place where its last ``m`` tokens occurred before
     (the longest ``m`` from ``--speculative-ngram-max-match-window-size`` down to the
     ``min``), and the tokens that followed there (code edited from the prompt, quoted
     documents, tool arguments that repeat earlier text).
A grammar's request gets only the leading drafts its grammar accepts.

Verification (the scheduler's forward): the request's entry computes its pending tokens and
the drafts in one extend through the paged attention; the LM head reads the rows of the last
pending token and of every draft.  Row ``j`` is sampled as if drafts ``1..j`` were accepted
(penalties over them, the grammar's mask after them, the seeded uniform of output step
``output_len + j``).  Drafts are accepted while each equals the token sampled before it; the
first sampled token that differs, or the one after the last draft, is appended too.  For a
deterministic draft this is the standard rejection-sampling rule (accept ``d`` with probability
``p(d)``, else draw from ``p`` without ``d``, renormalised), so sampled output keeps the model's
distribution; since every position draws the uniform it would draw without speculation, greedy
and seeded requests produce the tokens they produce without it (up to the float rounding that
separates an extend from single-token steps).

KV of the drafts: their slots are allocated from free pages only (a draft never evicts the
cache).  Row regions after verification (``c`` = computed_len before the step, ``r`` the pending
tokens, ``a`` the accepted drafts, ``k`` the drafts):
  ``[c, c + r + a)``            computed and kept (pending tokens and accepted drafts)
  ``[c + r + a, fill_len)``     the appended token, computed by the next step
  ``[fill_len, c + r + k)``     KV of rejected drafts: whole pages past ``fill_len`` are freed
                                now; computed_len never covers them, so they never enter the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from radixserve.speculative.base import DraftReqView, DraftSlots, Proposer, SpecState

if TYPE_CHECKING:
    from radixserve.cache.radix_tree import TreeNode
    from radixserve.config import ServerArgs

_ITEM = 8  # bytes per token id in a tree key


def tree_continuation(node: TreeNode, tail: np.ndarray, page_size: int,
                      limit: int) -> list[int]:
    """Up to ``limit`` tokens that follow ``tail`` below ``node`` in the radix tree (read only).

    ``node`` holds the request's tokens before ``tail``; the walk follows ``tail`` down, then
    takes what comes after it, through the most recently used child where the tree branches.
    Empty when the tree does not hold all of ``tail``.
    """
    key = tail.tobytes()
    n, pos = len(tail), 0
    while pos < n:
        child = None
        if n - pos >= page_size:
            first = (int(tail[pos]) if page_size == 1
                     else tuple(tail[pos : pos + page_size].tolist()))
            child = node.children.get(first)
        else:  # a partial page: any child whose run starts with it
            rest = key[pos * _ITEM :]
            starts = [c for c in node.children.values() if c.key_bytes.startswith(rest)]
            child = max(starts, key=lambda c: c.last_access, default=None)
        if child is None:
            return []
        m = min(len(child.value), n - pos)
        if child.key_bytes[: m * _ITEM] != key[pos * _ITEM : (pos + m) * _ITEM]:
            return []
        pos += m
        if m < len(child.value):  # tail ends inside this run: the draft starts there
            out = child.key[m : m + limit].tolist()
            node = child
            break
        node = child
    else:
        out = []
    while len(out) < limit and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out += node.key[: limit - len(out)].tolist()
    return out


def context_continuation(tokens: np.ndarray, min_window: int, max_window: int,
                         limit: int) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (``min_window`` to ``max_window`` tokens long); empty when none recurs."""
    total = len(tokens)
    if total < min_window + 1:
        return []
    # Candidate match ends e (exclusive, e < total): tokens[e - 1] == tokens[-1]; extended
    # backwards one position at a time while the suffix still agrees.
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1]) + 1
    best = ends if min_window <= 1 else None
    length = 1
    while length < max_window and len(ends):
        ends = ends[ends > length]  # room for one more token before the match
        if not len(ends):
            break
        ends = ends[tokens[ends - 1 - length] == tokens[total - 1 - length]]
        length += 1
        if len(ends) and length >= min_window:
            best = ends
    if best is None or not len(best):
        return []
    end = int(best[-1])
    return tokens[end : end + limit].tolist()


class NgramProposer(Proposer):
    """Drafts from the radix tree, else from the request's own prompt and output."""

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int,
                 disable_by_batch_size: int, use_tree: bool) -> None:
        super().__init__()
        self.max_drafts = num_draft_tokens - 1
        self.min_window = min_window
        self.max_window = max_window
        self.disable_by_batch_size = disable_by_batch_size
        self.use_tree = use_tree
        self.from_tree = 0  # drafts found in the radix tree (the rest: the request's own text)

    @classmethod
    def from_args(cls, args: ServerArgs) -> NgramProposer:
        return cls(args.speculative_num_draft_tokens, args.speculative_ngram_min_match_window_size,
                   args.speculative_ngram_max_match_window_size,
                   args.speculative_disable_by_batch_size, use_tree=not args.disable_radix_cache)

    def propose(self, decodes: Sequence[DraftReqView], kv: DraftSlots, context_len: int) -> int:
        """Stage drafts on the decoding requests and back them with free slots; return the
        number of draft tokens staged.  Every decoding request gets a SpecState (a verify)."""
        for req in decodes:
            if req.spec is None:
                req.spec = SpecState()
            req.spec.draft = []
        if len(decodes) > self.disable_by_batch_size:
            return 0
        drafted: list[DraftReqView] = []
        in_tree: set[int] = set()  # requests whose drafts the tree gave
        for req in decodes:
            room = min(self.max_drafts, req.params.max_new_tokens - req.output_len - 1,
                       context_len - req.fill_len - 1)
            if room <= 0:
                continue
            draft, tree = self._find(req, kv, room)
            if draft and req.grammar is not None:
                draft = draft[: req.grammar.valid_prefix(draft)]
            if draft:
                req.spec.draft = draft
                req.stage_draft(draft)
                drafted.append(req)
                if tree:
                    in_tree.add(id(req))
        # Slots for the drafts from free pages only; the latest admitted go without first.
        drafted.sort(key=lambda r: r.admit_seq)
        while drafted:
            need = sum(kv.new_pages_needed(r, r.remaining_extend + len(r.spec.draft))
                       for r in drafted)
            if need <= kv.allocator.num_free_pages:
                break
            drafted.pop().spec.draft = []
        if drafted and not kv.ensure_slots_many(
                drafted, [r.remaining_extend + len(r.spec.draft) for r in drafted]):
            for req in drafted:
                req.spec.draft = []
            return 0
        self.from_tree += sum(len(r.spec.draft) for r in drafted if id(r) in in_tree)
        return sum(len(r.spec.draft) for r in drafted)

    def _find(self, req: DraftReqView, kv: DraftSlots, room: int) -> tuple[list[int], bool]:
        if self.use_tree and req.kv.last_node is not None:
            found = tree_continuation(req.kv.last_node, req.tokens(req.kv.cached_len),
                                      kv.page_size, room)
            if found:
                return found, True
        return context_continuation(req.tokens(0), self.min_window, self.max_window, room), False

    def stats(self) -> dict[str, float | int]:
        return {**super().stats(), "spec_draft_tokens_from_tree": self.from_tree}
