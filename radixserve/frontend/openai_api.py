"""OpenAI-compatible routes: /v1/completions and /v1/models (the chat route is ``chat_api``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from radixserve.frontend.errors import APIError
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.openai_common import (
    choice_rids,
    chunk_event,
    fan_in,
    params_per_choice,
    server_state,
    start_stream,
    token_text,
    usage_dict,
)
from radixserve.frontend.protocol import CompletionRequest
from radixserve.frontend.state import ServerState, collect
from radixserve.ipc.messages import CacheReport
from radixserve.runtime.pieces import Piece, merge
from radixserve.sampling import SamplingParams

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> JSONBytesResponse:
    st = server_state(request)
    return JSONBytesResponse({
        "object": "list",
        "data": [{
            "id": st.model_name, "object": "model", "created": int(st.started_at),
            "owned_by": "radixserve", "root": st.model_path, "parent": None,
            "max_model_len": st.info.context_length,
        }] + [{  # the LoRA adapters, as vLLM lists them
            "id": name, "object": "model", "created": int(st.started_at),
            "owned_by": "radixserve", "root": path, "parent": st.model_name,
            "max_model_len": st.info.context_length,
        } for name, path in st.loras.items()],
    })


def _completion_logprobs(st: ServerState, ids: list[int], lps: list[float | None],
                         tops: list[Any], offset: int) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` for ``ids``; ``text_offset`` counts from ``offset``.

    A None logprob / top list (the first prompt token under ``echo``) stays None (null).
    """
    tokens = [token_text(st, t) for t in ids]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = []
    for j in range(len(ids)):
        alts = tops[j] if j < len(tops) else []
        top.append(None if alts is None else {token_text(st, int(t)): v for t, v in alts})
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": offsets}


def _join_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """The prompt's logprobs (``echo``) followed by the completion's."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    """OpenAI completions.  ``echo`` with ``logprobs`` returns the prompt tokens' logprobs
    (the first one null) followed by the completion's, computed in the same prefill: those
    requests ask the scheduler for prompt logprobs from position 0, so their prompt is
    computed even when it is cached."""
    st = server_state(request)
    st.check_model(body.model, body.lora_path)
    call = _prepare_completion(st, body)
    if not body.stream:
        return await _completion_response(call, request)
    return await start_stream(_completion_chunks(call))


@dataclass
class _CompletionCall:
    """One completion request, validated: its prompts and each choice's job."""

    st: ServerState
    body: CompletionRequest
    prepared: list[tuple[list[int], SamplingParams]]  # per prompt
    cid: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.jobs = [(ids, cp) for ids, params in self.prepared
                     for cp in params_per_choice(params, self.body.n)]
        self.want_lp = self.body.logprobs is not None
        self.echo_lp = self.body.echo and self.want_lp
        self.echo_text = [self.st.tokenizer.decode(ids) if self.body.echo else ""
                          for ids, _ in self.jobs]
        self.prompt_tokens = sum(len(ids) for ids, _ in self.prepared)

    def streams(self, stream: bool) -> list[AsyncIterator[Piece]]:
        rids = choice_rids(self.body.rid, len(self.jobs))
        hints = self.body.hints(len(self.jobs), len(self.prepared),
                                self.st.check_model(self.body.model, self.body.lora_path))
        return [self.st.stream(ids, p, stream=stream, logprob=self.want_lp,
                               top_n=self.body.logprobs or 0, rid=rid,
                               logprob_start_len=0 if self.echo_lp else -1, hints=h)
                for (ids, p), rid, h in zip(self.jobs, rids, hints, strict=True)]

    def prompt_logprobs(self, i: int, piece: Piece) -> dict[str, Any] | None:
        """Choice i's prompt part (echo + logprobs), from the piece that carries it."""
        if not self.echo_lp:
            return None
        return _completion_logprobs(self.st, self.jobs[i][0], piece.input_logprobs,
                                    piece.input_top_logprobs, 0)

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None,
              progress: tuple[int, int] | None = None) -> bytes:
        """A chunk of the stream; ``progress``: its choice's prompt and completion tokens."""
        head = {"id": self.cid, "object": "text_completion", "created": self.created,
                "model": self.st.model_name}
        return chunk_event(head, choices, self.body, usage, progress)


def _prepare_completion(st: ServerState, body: CompletionRequest) -> _CompletionCall:
    sampling = body.sampling_dict(body.max_tokens)
    prepared = []
    for k, p in enumerate(body.prompts()):
        try:
            prepared.append(st.prepare(p if isinstance(p, str) else None,
                                       p if isinstance(p, list) else None, sampling,
                                       check_total=True, prompt_param="prompt"))
        except APIError as e:
            if len(body.prompts()) > 1:
                e.message = f"prompt {k}: {e.message}"
            raise
    return _CompletionCall(st, body, prepared)


async def _completion_response(call: _CompletionCall, request: Request) -> JSONBytesResponse:
    st, body = call.st, call.body
    results = [merge(r) for r in await asyncio.gather(
        *[collect(s, request) for s in call.streams(False)]
    )]
    choices = [{
        "index": i,
        "text": call.echo_text[i] + r.text,
        "logprobs": _join_logprobs(
            call.prompt_logprobs(i, r),
            _completion_logprobs(st, r.output_ids, r.logprobs, r.top_logprobs,
                                 len(call.echo_text[i])),
        ) if call.want_lp else None,
        "finish_reason": r.meta.finish_type,
    } for i, r in enumerate(results)]
    cached = sum(results[k * body.n].meta.cached_tokens for k in range(len(call.prepared)))
    usage = usage_dict(call.prompt_tokens, sum(r.meta.completion_tokens for r in results), cached,
                       results[0].meta.cache_report)
    return JSONBytesResponse({"id": call.cid, "object": "text_completion", "created": call.created,
                              "model": st.model_name, "choices": choices, "usage": usage})


async def _completion_chunks(call: _CompletionCall) -> AsyncIterator[bytes]:
    st, body = call.st, call.body
    completion, cached = 0, 0
    report: CacheReport | None = None
    sent_echo: set[int] = set()
    text_pos = [0] * len(call.jobs)  # characters of choice i's text sent so far
    # Per choice, logprobs not sent yet: a piece whose text is held back (a character
    # split across tokens) sends its tokens' logprobs with the next chunk that has text.
    held: list[dict[str, Any]] = [
        {"prompt": None, "ids": [], "lps": [], "tops": []} for _ in call.jobs
    ]
    async for i, piece in fan_in(call.streams(True)):
        text = piece.text
        start = text_pos[i]  # where this chunk's completion text begins
        if i not in sent_echo:
            sent_echo.add(i)
            text = call.echo_text[i] + text
            start += len(call.echo_text[i])
            held[i]["prompt"] = call.prompt_logprobs(i, piece)
        h = held[i]
        h["ids"] += piece.output_ids
        h["lps"] += piece.logprobs
        h["tops"] += piece.top_logprobs
        finished = piece.finished
        if text or finished:
            lp = None
            if call.want_lp:
                lp = _join_logprobs(
                    h["prompt"], _completion_logprobs(st, h["ids"], h["lps"], h["tops"], start)
                )
                held[i] = {"prompt": None, "ids": [], "lps": [], "tops": []}
            text_pos[i] += len(text)
            yield call.chunk([{"index": i, "text": text, "logprobs": lp,
                               "finish_reason": piece.meta.finish_type if finished else None}],
                             progress=(len(call.jobs[i][0]), piece.meta.completion_tokens))
        if finished:
            completion += piece.meta.completion_tokens
            if i % body.n == 0:
                cached += piece.meta.cached_tokens
            if i == 0:
                report = piece.meta.cache_report
    if body.include_usage:
        yield call.chunk([], usage_dict(call.prompt_tokens, completion, cached, report))
    yield b"data: [DONE]\n\n"
