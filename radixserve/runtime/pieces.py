"""What a running request yields: typed pieces, in radixserve's internal shape.

A :class:`Piece` is the part of a request's output one reply brought (the new text, ids and
their logprobs), with the request's ``meta`` so far; :func:`merge` folds a finished request's
pieces into one.  The route handlers and the Engine shape them for their callers (OpenAI,
SGLang's native shape in ``native_output.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.ipc.messages import (
    CacheReport,
    FinishReason,
    Logprob,
    PinResult,
    ReqMeta,
    TopLogprobs,
)


@dataclass
class RequestMeta:
    """A request as of its latest piece.  ``id``: the client's request id;
    ``finish_reason``: None until the last piece; ``ttft`` from the first token on, and
    ``e2e_latency`` on the last piece (seconds since it was sent); what the request asked for:
    ``pin`` (the pin made as it finished), ``cache_report``; ``cached_tokens_details``: the
    hit by the tier it came from (with KV tiers); ``spec``: the speculative decoding counters."""

    id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    queue_time: float | None = None
    ttft: float | None = None
    e2e_latency: float | None = None
    pin: PinResult | None = None
    cached_tokens_details: dict[str, int] | None = None
    cache_report: CacheReport | None = None
    spec: dict[str, float] | None = None

    @classmethod
    def of_row(
        cls, rid: str, row: ReqMeta, finished: FinishReason | None, **timing: float | None
    ) -> RequestMeta:
        """The scheduler's description of one row, for the client's request ``rid``;
        ``timing``: ``ttft`` and ``e2e_latency`` where known."""
        return cls(
            rid,
            row.prompt_tokens,
            row.cached_tokens,
            row.completion_tokens,
            finished,
            row.queue_time,
            pin=row.pin,
            cached_tokens_details=row.cached_tokens_details,
            cache_report=row.cache_report,
            spec=row.spec,
            **timing,
        )

    @property
    def finish_type(self) -> str | None:
        return None if self.finish_reason is None else self.finish_reason.type

    def info(self) -> dict[str, Any]:
        """SGLang's ``meta_info`` (``/generate``, ``Engine.generate``)."""
        d: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "queue_time": self.queue_time,
        }
        if self.pin is not None:
            d["pin"] = self.pin.to_dict()
        if self.cached_tokens_details:
            d["cached_tokens_details"] = self.cached_tokens_details
        if self.cache_report is not None:
            d["cache_report"] = self.cache_report.to_dict()
        d.update(self.spec or {})
        d["id"] = self.id
        d["finish_reason"] = None if self.finish_reason is None else self.finish_reason.to_dict()
        if self.ttft is not None:
            d["ttft"] = self.ttft
        if self.e2e_latency is not None:
            d["e2e_latency"] = self.e2e_latency
        return d


@dataclass
class Piece:
    """``logprobs`` / ``top_logprobs``: of ``output_ids`` (with ``return_logprob``; the top
    ones as ``[token_id, logprob]`` pairs).  ``input_logprobs`` / ``input_top_logprobs``: of the
    prompt positions from the scheduler's ``logprob_start_len`` on, on the first piece only
    (None elsewhere)."""

    text: str
    output_ids: list[int]
    meta: RequestMeta
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
        meta=pieces[-1].meta,
        finished=pieces[-1].finished,
        logprobs=[lp for p in pieces for lp in p.logprobs],
        top_logprobs=[t for p in pieces for t in p.top_logprobs],
        input_logprobs=None if first is None else first.input_logprobs,
        input_top_logprobs=None if first is None else first.input_top_logprobs,
    )
