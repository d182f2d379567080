"""The scheduler's side of constrained decoding: grammars, token masks, jump-forward, and
``min_new_tokens``.

Per step, for the rows that sample:
  1. ``mask_logits``: rows with a grammar get xgrammar's bitmask of allowed next tokens
     (filled per request into one ``[B, V/32]`` int32 buffer, applied to the whole batch in
     one call; rows without a grammar are untouched); rows below ``min_new_tokens`` get their
     EOS and stop token ids set to -inf.  The mask goes in before logit_bias and penalties,
     which keep -inf at -inf, so the order does not matter.
  2. ``after_token``: the sampled token is accepted by the matcher; the request finishes when
     the grammar is complete and only a stop token could follow (no extra decode step for
     the EOS); otherwise the text the grammar forces next (keys, braces, enum tails) is
     appended at once ("jump-forward") and computed in the next forward as a short extend,
     instead of one decode step per token.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from radixserve.ipc.messages import FinishReason
from radixserve.scheduler.request import Req
from radixserve.tokenizer import DeferredTokenizer
from radixserve.transfer import Upload, resolve

logger = logging.getLogger(__name__)


class Constraints:
    def __init__(
        self,
        backend: str,
        tokenizer: Any | None,
        vocab_size: int,
        eos_token_ids: list[int],
        jump_forward: bool,
    ) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.jump_forward_enabled = jump_forward
        self._tokenizer: Any | None = None
        self._compiler: Any = None
        self._bitmask: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        if tokenizer is not None:
            self.attach_tokenizer(tokenizer)
        # Counters reported in the scheduler's stats.
        self.jump_forward_tokens = 0
        self.mask_seconds = 0.0
        self.mask_steps = 0

    def attach_tokenizer(self, tokenizer: Any) -> None:
        """The Hugging Face tokenizer grammars are compiled against, or a DeferredTokenizer
        that loads it when the first grammar request comes (transformers' import takes seconds
        of CPU that a start without grammars need not pay)."""
        self._tokenizer = tokenizer
        if self.backend != "none" and not isinstance(tokenizer, DeferredTokenizer):
            self.compiler  # noqa: B018 - set up at start, its token tables in the background

    # ---- arrival -----------------------------------------------------------------------
    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            from radixserve.grammar import GrammarCompiler

            if isinstance(self._tokenizer, DeferredTokenizer):
                logger.info("loading the tokenizer for the first grammar request")
                self._tokenizer = self._tokenizer.get()
            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def on_arrival(self, req: Req) -> None:
        """Start compiling the request's grammar; ValueError when it cannot have one."""
        key = req.params.grammar
        if key is None:
            return
        if self.backend == "none":
            raise ValueError(
                f"sampling_params.{key[0]}: constrained decoding is off on this server "
                "(--grammar-backend none)"
            )
        if self._tokenizer is None:
            raise ValueError(f"sampling_params.{key[0]}: constrained decoding needs a tokenizer")
        req.grammar_future = self.compiler.submit(key)

    def poll(self, req: Req) -> str | None:
        """For a waiting request: ``"ready"``, ``"compiling"``, or an error message."""
        fut: Future | None = req.grammar_future
        if fut is None or req.grammar is not None:
            return "ready"
        if not fut.done():
            return "compiling"
        try:
            compiled = fut.result()
        except ValueError as e:
            return str(e)
        from radixserve.grammar import RequestGrammar

        json_rows = req.params.grammar[0] == "json_schema"
        req.grammar = RequestGrammar(
            compiled, self.eos_token_ids,
            self.compiler.json_words if json_rows else self.compiler.utf8_words,
        )
        req.grammar.sync(req.output_ids)
        return "ready"

    # ---- sampling ----------------------------------------------------------------------
    def mask_logits(
        self, logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]] | None = None
    ) -> None:
        """Mask ``logits`` (the sampling rows of ``reqs``) in place.  A request with ``drafts[i]``
        (k speculative tokens) owns ``k + 1`` consecutive rows; row ``j`` is masked as if
        ``drafts[i][:j]`` followed its output."""
        counts = [1 + len(drafts[i]) if drafts is not None else 1 for i in range(len(reqs))]
        starts = np.cumsum([0] + counts[:-1]).tolist() if reqs else []
        num_rows = sum(counts)
        grammar_reqs = [i for i, r in enumerate(reqs) if r.grammar is not None]
        banned_rows: list[int] = []
        banned_cols: list[int] = []
        for i, r in enumerate(reqs):
            below = r.params.min_new_tokens - r.output_len  # rows still under min_new_tokens
            if below <= 0:
                continue
            stops = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                stops.update(self.eos_token_ids)
            for j in range(min(below, counts[i])):
                banned_rows += [starts[i] + j] * len(stops)
                banned_cols += sorted(stops)
        if not grammar_reqs and not banned_rows:
            return
        upload = Upload(logits.device)  # the masks' one copy to the device
        bitmask = banned = None
        if grammar_reqs:
            import xgrammar as xgr

            t0 = time.perf_counter()
            host = self._bitmask_for(num_rows)[:num_rows]
            host.fill_(-1)  # rows without a grammar: every token allowed
            for i in grammar_reqs:
                draft = drafts[i] if drafts is not None else []
                reqs[i].grammar.fill_draft_rows(host, starts[i], draft)
            bitmask = upload.add(host.numpy(), np.int32)
        if banned_rows:
            banned = (upload.add(banned_rows), upload.add(banned_cols))
        upload.send()
        bitmask, banned = resolve((bitmask, banned))
        if bitmask is not None:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
            self.mask_seconds += time.perf_counter() - t0
            self.mask_steps += 1
        if banned is not None:
            logits.index_put_(banned, logits.new_full((len(banned_rows),), float("-inf")))

    def _bitmask_for(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask

    # ---- after sampling ----------------------------------------------------------------
    def after_token(self, req: Req) -> tuple[FinishReason | None, list[int]]:
        """Accept the newest output token; return (finish reason or None, forced tokens).

        The forced tokens are not appended here; the caller appends and accepts them
        (``accept_forced``) after its stop checks, capped by ``max_new_tokens``.
        """
        g = req.grammar
        if g is None:
            return None, []
        token = req.output_ids[-1]
        if not g.accept(token):
            logger.warning("request %s: sampled token %d is outside its grammar", req.rid, token)
            return FinishReason("stop"), []
        if g.terminated:
            # A stop token the stop checker let through (ignore_eos): the grammar allows
            # nothing after it, and a terminated matcher has no next-token mask.
            return FinishReason("stop", token), []
        if self._scratch is None:
            import xgrammar as xgr

            self._scratch = xgr.allocate_token_bitmask(1, self.vocab_size)
        if g.only_stop_allowed(self._scratch):
            return FinishReason("stop"), []
        if not self.jump_forward_enabled or req.return_logprob:
            return None, []  # forced tokens have no logprobs: keep output and logprobs aligned
        return None, g.jump_forward()

    def accept_forced(self, req: Req, tokens: list[int]) -> int:
        """Accept forced ``tokens`` (already appended to the output); returns how many."""
        g = req.grammar
        n = 0
        for t in tokens:
            if not g.accept(t):
                break
            n += 1
        self.jump_forward_tokens += n
        return n

    def stats(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "jump_forward_tokens": self.jump_forward_tokens,
            "grammar_mask_ms_per_step": (
                1000 * self.mask_seconds / self.mask_steps if self.mask_steps else 0.0
            ),
        }
        if self._compiler is not None:
            times = list(self._compiler.compile_seconds.values())
            d["grammars_compiled"] = len(times)
            d["grammar_compile_ms_total"] = 1000 * sum(times)
        return d

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
