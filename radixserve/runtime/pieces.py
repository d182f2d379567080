"""What a running request yields: typed pieces, in radixserve's internal shape.

A :class:`Piece` is the part of a request's output one reply brought (the new text, ids and
their logprobs), with the request's ``meta`` so far; :func:`merge` folds a finished request's
pieces into one.  The route handlers and the Engine shape them for their callers (OpenAI,
SGLang's native shape in ``native_output.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.ipc.messages import Logprob, TopLogprobs


@dataclass
class Piece:
    """``logprobs`` / ``top_logprobs``: of ``output_ids`` (with ``return_logprob``; the top
    ones as ``[token_id, logprob]`` pairs).  ``input_logprobs`` / ``input_top_logprobs``: of the
    prompt positions from the scheduler's ``logprob_start_len`` on, on the first piece only
    (None elsewhere).  ``meta``: ``id``, ``prompt_tokens``, ``cached_tokens``,
    ``completion_tokens``, ``finish_reason`` (None until the last piece), ``ttft``,
    ``e2e_latency`` (last piece), and what the request asked for (``cache_report``, ``pin``)."""

    text: str
    output_ids: list[int]
    meta: dict[str, Any]
    finished: bool
    logprobs: list[Logprob] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[Logprob] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None


def merge(pieces: list[Piece]) -> Piece:
    """A request's pieces as one: texts, ids and logprobs joined, the last meta."""
    first = next((p for p in pieces if p.input_logprobs is not None), None)  # sent once
    return Piece(
        text="".join(p.text for p in pieces),
        output_ids=[t for p in pieces for t in p.output_ids],
        meta=dict(pieces[-1].meta),
        finished=pieces[-1].finished,
        logprobs=[lp for p in pieces for lp in p.logprobs],
        top_logprobs=[t for p in pieces for t in p.top_logprobs],
        input_logprobs=None if first is None else first.input_logprobs,
        input_top_logprobs=None if first is None else first.input_top_logprobs,
    )
