"""Per-request grammar state: an xgrammar matcher over the shared compiled grammar.

The matcher has accepted exactly the request's output tokens (``num_accepted ==
output_len``).  It survives retraction with the request (the output is kept and recomputed,
so the matcher stays valid); :meth:`sync` rebuilds it from the output ids if the two ever
disagree.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(
        self, compiled: Any, stop_token_ids: list[int], allowed_words: torch.Tensor | None = None
    ) -> None:
        """``allowed_words``: an extra ``[V/32]`` bitmask ANDed into every mask (see
        ``GrammarCompiler.json_words``)."""
        import xgrammar as xgr

        self._compiled = compiled
        self._allowed_words = allowed_words
        self._stop_ids = list(stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_ids or None)
        self.num_accepted = 0
        self.dead = False  # a token the grammar refused was forced in (must not happen)

    def accept(self, token: int) -> bool:
        if self.matcher.is_terminated():
            return False
        ok = self.matcher.accept_token(token)
        if ok:
            self.num_accepted += 1
        else:
            self.dead = True
            logger.warning("grammar refused token %d after %d tokens", token, self.num_accepted)
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (one bit per token)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self._allowed_words is not None:
            bitmask[row] &= self._allowed_words

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts after the output so far (speculative
        drafts); the matcher's state is left as it was."""
        n = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            n += 1
            if self.matcher.is_terminated():  # a stop token: no mask after it (none needed)
                self.matcher.rollback(1)
                n -= 1
                break
        if n:
            self.matcher.rollback(n)
        return n

    def fill_draft_rows(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        """Masks of ``len(draft) + 1`` consecutive rows from ``row``: row ``row + j`` allows
        what may follow the output and ``draft[:j]`` (drafts from :meth:`valid_prefix`); the
        matcher's state is left as it was."""
        for j, t in enumerate(draft):
            self.fill(bitmask, row + j)
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"grammar refused draft token {t} it accepted when drafted")
        self.fill(bitmask, row + len(draft))
        if draft:
            self.matcher.rollback(len(draft))

    def jump_forward(self) -> list[int]:
        """Tokens of the text the grammar forces next (may be empty); not yet accepted.

        xgrammar tokenizes the forced text greedily and leaves out a last token that is a
        strict prefix of a longer token, so the boundary with what the model samples next is
        never split in a way the model could not have chosen itself.
        """
        if self.matcher.is_terminated():
            return []
        return list(self.matcher.find_jump_forward_tokens())

    @property
    def completed(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may still go on)."""
        return self.matcher.is_completed()

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def only_stop_allowed(self, scratch: torch.Tensor) -> bool:
        """The grammar is complete and nothing but a stop token may follow."""
        if not self.matcher.is_completed():
            return False
        self.matcher.fill_next_token_bitmask(scratch, 0)
        words = scratch[0].numpy().view(np.uint32).copy()
        for t in self._stop_ids:
            words[t // 32] &= ~np.uint32(1 << (t % 32))
        return not words.any()

    def sync(self, output_ids: list[int]) -> None:
        """Rebuild the matcher from scratch if it has not accepted exactly ``output_ids``."""
        if self.num_accepted == len(output_ids) and not self.dead:
            return
        self.matcher.reset()
        self.num_accepted = 0
        self.dead = False
        for t in output_ids:
            if not self.accept(t):
                break
