"""Stop conditions, checked after every sampled token."""

from __future__ import annotations

from typing import Any

from radixserve.ipc.messages import FinishReason
from radixserve.scheduler.request import Req


class StopChecker:
    def __init__(self, eos_token_ids: set[int], context_len: int, tokenizer: Any | None) -> None:
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.tokenizer = tokenizer  # only needed for stop strings

    def check(self, req: Req, new_tokens: int = 1) -> FinishReason | None:
        """Why ``req`` must stop after its newest ``new_tokens`` tokens, or None to go on.

        Several new tokens come from jump-forward (grammar-forced text); they never hold
        EOS, so only the newest is checked for stop token ids.
        """
        token = req.output_ids[-1]
        params = req.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason("stop", token)
        if token in params.stop_token_ids:
            return FinishReason("stop", token)
        if params.stop and self.tokenizer is not None:
            matched = self._match_stop_string(req, new_tokens)
            if matched is not None:
                return FinishReason("stop", matched)
        if req.output_len >= params.max_new_tokens or req.fill_len >= self.context_len:
            return FinishReason("length", length=req.output_len)
        return None

    def _match_stop_string(self, req: Req, new_tokens: int = 1) -> str | None:
        # A stop string completed by the newest tokens lies in their text plus len(s) more
        # characters; a few extra tokens cover tokens that decode to partial characters.
        window = max(len(s) for s in req.params.stop) + 3 + new_tokens
        tail = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.params.skip_special_tokens
        )
        for s in req.params.stop:
            if s in tail:
                return s
        return None
