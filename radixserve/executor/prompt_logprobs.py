"""Prompt logprobs: the logprob of every prompt token from ``logprob_start_len`` on.

The logprob of prompt token ``p`` is ``log_softmax(logits at position p - 1)[prompt[p]]``, so a
request that asks from ``start`` needs the logits at positions ``[max(start - 1, 0),
prompt_len - 1)`` (the logits at ``prompt_len - 1`` are the ones the first output token is
sampled from).  They are computed in the same forward as the prompt's K/V: the model's LM
head reads these extra rows of the batch (only for requests that asked), chunk by chunk, and
:func:`record` appends them to the request's ``PromptLogprobs`` (``scheduler/request.py``).

Tokens served from the radix cache have K/V but no logits, so while logits are still owed
the request's prefix match stops at :attr:`PromptLogprobs.next_pos` (see
``KVManager.match_limit``): a cached prefix before ``logprob_start_len`` is still read from
the tree, the rest is recomputed (what SGLang does).  A request retracted mid-prefill keeps
what it has collected and, re-admitted, recomputes from there; one retracted while decoding
has collected (and sent) everything, matches the tree fully and sends nothing twice.

The values are the model's own distribution (no logit bias, penalties or temperature).
They are sent once, with the request's first output row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixserve.sampling.logprobs import token_logprobs

if TYPE_CHECKING:
    from radixserve.executor.req_view import ReqView
    from radixserve.ipc.messages import TokenOut


@dataclass
class PromptLogprobPlan:
    """Which rows of one forward feed prompt logprobs.

    ``rows[j]``: index in ``[0, T)`` of the batch token whose logits give the logprob of
    ``targets[j]`` (the next prompt token); ``owners`` lists ``(request, count)`` in row
    order, so the results split back per request.
    """

    rows: np.ndarray
    targets: np.ndarray
    owners: list[tuple[ReqView, int]]

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def plan_rows(entries: list[tuple[ReqView, int]]) -> PromptLogprobPlan | None:
    """Extra LM-head rows of a forward whose entry ``(req, n)`` computes
    ``fill_ids[computed_len : computed_len + n]``."""
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    owners: list[tuple[ReqView, int]] = []
    offset = 0  # index of the entry's first token in the batch
    for req, n in entries:
        state = req.prompt_logprobs
        if state is not None and state.pending:
            if req.kv.computed_len > state.next_pos:
                raise RuntimeError(
                    f"{req!r} skipped prompt positions [{state.next_pos}, {req.kv.computed_len}) "
                    "whose logits are owed; its prefix match should have stopped there"
                )
            # Positions computed now: [computed_len, computed_len + n).
            # Owed: [next_pos, prompt_len - 1).  Rows: their intersection, [lo, hi).
            lo = state.next_pos
            hi = min(req.kv.computed_len + n, state.prompt_len - 1)
            if lo < hi:
                rows.append(
                    np.arange(
                        offset + lo - req.kv.computed_len,
                        offset + hi - req.kv.computed_len,
                        dtype=np.int64,
                    )
                )
                targets.append(np.asarray(req.tokens(lo + 1, hi + 1), dtype=np.int64))
                owners.append((req, hi - lo))
        offset += n
    if not owners:
        return None
    return PromptLogprobPlan(np.concatenate(rows), np.concatenate(targets), owners)


def record(plan: PromptLogprobPlan, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Turn the extra rows' logits ``[plan.num_rows, vocab]`` into the owners' prompt logprobs;
    ``targets``: ``plan.targets`` on the logits' device (uploaded with the batch)."""
    top_ns = [req.prompt_logprobs.top_n for req, count in plan.owners for _ in range(count)]
    values, tops = token_logprobs(logits, targets, top_ns)
    pos = 0
    for req, count in plan.owners:
        state = req.prompt_logprobs
        state.logprobs.extend(values[pos : pos + count])
        state.top.extend(tops[pos : pos + count])
        state.next_pos += count
        pos += count


def attach_prompt_logprobs(out: TokenOut, req: ReqView) -> None:
    """Add the request's prompt logprobs to its row of ``out`` the first time they are complete.

    Rows of other requests (and later rows) get None; a request aborted before its prompt
    was computed gets None too.
    """
    state = req.prompt_logprobs
    if state is None or state.sent or state.pending:
        out.input_logprobs.append(None)
        out.input_top_logprobs.append(None)
        return
    state.sent = True
    out.input_logprobs.append(state.logprobs)
    out.input_top_logprobs.append(state.top)
