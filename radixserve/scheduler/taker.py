"""What a forward sampled, taken into its requests' outputs.

A decode row gives one token; a decode with k speculative drafts gives the drafts the target
model agreed with and the token after them.  Each token goes through the stop checks, and a
request under a grammar advances its matcher and appends the text the grammar forces next
(jump-forward), computed by the next forward as part of its decode entry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.scheduler.request import Req, ReqState

if TYPE_CHECKING:
    from radixserve.sampling import SampleOutput
    from radixserve.scheduler.constraints import Constraints
    from radixserve.scheduler.kv_manager import KVManager
    from radixserve.scheduler.stats import SchedulerStats
    from radixserve.scheduler.stop import StopChecker
    from radixserve.speculative import Proposer


class TokenTaker:
    def __init__(self, stop_checker: StopChecker, constraints: Constraints, spec: Proposer | None,
                 kv: KVManager, stats: SchedulerStats, context_len: int) -> None:
        self.stop_checker = stop_checker
        self.constraints = constraints
        self.spec = spec
        self.kv = kv
        self.stats = stats
        self.context_len = context_len

    def take(self, req: Req, out: SampleOutput, row: int, k: int) -> None:
        """Append what the rows ``[row, row + k + 1)`` sampled for ``req``: without drafts its
        one token; with k drafts the accepted ones and the token after them, up to a stop."""
        tokens = out.next_token_ids[row : row + k + 1]
        accepted = (
            self.spec.accept(req, tokens) if self.spec is not None and req.spec is not None else 0
        )
        new = tokens[: accepted + 1] if k else tokens
        taken = 0
        for j, token in enumerate(new):
            req.append_output(token)
            taken += 1
            self.stats.generation_tokens += 1
            if req.return_logprob and out.logprobs is not None:
                req.out.logprobs.append(out.logprobs[row + j])
                req.out.top_logprobs.append(
                    [[t, lp] for t, lp in out.top_logprobs[row + j]] if out.top_logprobs else []
                )
            req.finish_reason = self.stop_checker.check(req)
            if req.grammar is not None and req.finish_reason is None:
                # Text the grammar forces is appended after the last token only: the accepted
                # drafts before it are tokens the grammar allowed.
                self.advance_grammar(req, jump=j == len(new) - 1)
            if req.finished:
                break
        if self.spec is not None and req.spec is not None and req.state == ReqState.RUNNING:
            kept = min(taken, accepted)  # accepted drafts that became output: their KV is kept
            req.kv.computed_len += kept
            self.spec.record(req, kept)
            if not req.finished:
                self.kv.trim(req)

    def advance_grammar(self, req: Req, jump: bool = True) -> None:
        """Accept the sampled token; finish when the grammar is done, else (with ``jump``)
        append the text it forces (computed by the next forward as part of this request's
        decode entry)."""
        reason, forced = self.constraints.after_token(req)
        if reason is not None:
            req.finish_reason = reason
            return
        if not jump:
            return
        room = min(req.params.max_new_tokens - req.output_len, self.context_len - req.fill_len - 1)
        forced = forced[: max(0, room)]
        # A stop token id inside the forced text ends the output there, as it would have if
        # the model had been made to sample it (the stop checker looks at the newest token).
        stop_at = [i for i, t in enumerate(forced) if t in req.params.stop_token_ids]
        if stop_at:
            forced = forced[: stop_at[0] + 1]
        if not forced:
            return
        for t in forced:
            req.append_output(t)
        self.constraints.accept_forced(req, forced)
        req.finish_reason = self.stop_checker.check(req, new_tokens=len(forced))
