"""What one scheduler step sends on: the rows of its TokenOut.

A row goes out for every request that finished this step, and, every ``stream_interval``
steps, for every streaming request with tokens not sent yet.  It carries the new ids, the
finish reason, the request's counts (:class:`ReqMeta`), the detokenizer settings on the
request's first row, and the logprobs collected since the last row.
"""

from __future__ import annotations

import time

from radixserve.executor.prompt_logprobs import attach_prompt_logprobs
from radixserve.ipc.messages import CacheReport, DetokSettings, ReqMeta, TokenOut
from radixserve.scheduler.request import Req


def rows_to_send(finished: list[Req], running: list[Req], stream_now: bool) -> list[Req]:
    """The finished requests, and with ``stream_now`` the streaming ones with unsent tokens."""
    rows = list(finished)
    if stream_now:
        rows += [
            r for r in running if r.stream and r.output_len > r.out.sent_len and not r.finished
        ]
    return rows


def token_out(rows: list[Req]) -> TokenOut:
    """The TokenOut of ``rows``; each row's tokens, logprobs and first-row settings are sent."""
    out = TokenOut(rids=[], new_ids=[], finished=[], meta=[], init=[], logprobs=[], top_logprobs=[])
    now = time.perf_counter()
    for req in rows:
        out.rids.append(req.rid)
        out.new_ids.append(req.output_ids[req.out.sent_len :])
        req.out.sent_len = req.output_len
        out.finished.append(req.finish_reason)
        out.meta.append(ReqMeta(
            prompt_tokens=req.prompt_len,
            cached_tokens=req.hit.tokens or 0,
            completion_tokens=req.output_len,
            queue_time=req.queue_time,
            since_first_token=now - req.first_token_time if req.first_token_time else 0.0,
            pin=req.pin_result,
            cached_tokens_details=req.hit.by_tier or None,
            cache_report=cache_report(req) if req.return_cache_report else None,
            spec=(req.spec.meta(req.output_len) if req.spec is not None else None) or None,
        ))
        if req.out.sent_init:
            out.init.append(None)
        else:
            req.out.sent_init = True
            p = req.params
            out.init.append(DetokSettings(p.stop, p.skip_special_tokens, p.no_stop_trim))
        out.logprobs.append(req.out.logprobs if req.return_logprob else None)
        out.top_logprobs.append(req.out.top_logprobs if req.return_logprob else None)
        attach_prompt_logprobs(out, req)
        req.out.logprobs, req.out.top_logprobs = [], []
    return out


def cache_report(req: Req) -> CacheReport:
    """Where the request's prefix match stopped (``return_cache_report``)."""
    if req.hit.divergence is None:
        return CacheReport(req.hit.tokens or 0)
    return CacheReport(req.hit.tokens or 0, **req.hit.divergence.to_dict())
