"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import ORJSONResponse, StreamingResponse

from radixserve.frontend.errors import APIError
from radixserve.frontend.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.frontend.serving import ServerState, collect, merge_pieces
from radixserve.sampling import SamplingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _finish(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason.get("type")


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: distinct seeds (the user's seed + i keeps them reproducible)."""
    if n == 1:
        return [params]
    base = params.seed
    return [dataclasses.replace(params, seed=None if base is None else base + i) for i in range(n)]


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _render_chat(st: ServerState, body: ChatCompletionRequest) -> str:
    msgs = []
    for m in body.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        msgs.append(d)
    tok = st.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", 400, param="messages")
    try:
        return tok.apply_chat_template(
            msgs,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            tokenize=False,
        )
    except Exception as e:  # template errors (jinja) are the request's fault
        raise APIError(f"cannot apply the chat template to these messages: {e}", 400, param="messages") from e


async def _fan_in(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several requests' pieces as ``(index, piece)``; an error ends everything."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for piece in s:
                await queue.put((i, piece))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item["finished"]:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _start_stream(gen: AsyncIterator[bytes]) -> StreamingResponse:
    """Run the generator to its first chunk before answering, so errors keep their status."""
    it = gen.__aiter__()
    first = await it.__anext__()

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in it:
            yield chunk

    return StreamingResponse(body(), media_type="text/event-stream")


def _token_str(st: ServerState, tok: int) -> str:
    return st.tokenizer.decode([tok])


def _chat_logprobs(st: ServerState, ids: list[int], lps: list[float], tops: list[Any]) -> dict[str, Any]:
    content = []
    for j, (tok, lp) in enumerate(zip(ids, lps, strict=False)):
        s = _token_str(st, tok)
        alts = tops[j] if j < len(tops) and tops[j] else []
        content.append({
            "token": s, "logprob": lp, "bytes": list(s.encode()),
            "top_logprobs": [
                {"token": (a := _token_str(st, int(t))), "logprob": v, "bytes": list(a.encode())}
                for t, v in alts
            ],
        })
    return {"content": content}


@router.get("/v1/models")
async def models(request: Request) -> ORJSONResponse:
    st = _state(request)
    return ORJSONResponse({
        "object": "list",
        "data": [{
            "id": st.model_name, "object": "model", "created": int(st.started_at),
            "owned_by": "radixserve", "max_model_len": st.info["context_length"],
        }],
    })


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    st = _state(request)
    st.check_model(body.model)
    prompt = _render_chat(st, body)
    ids, params = st.prepare(prompt, None, body.sampling_dict(body.max_new_tokens), check_total=True)
    top_n = body.top_logprobs or 0
    choice_params = _choice_params(params, body.n)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), st.model_name

    def streams(stream: bool) -> list[AsyncIterator[dict[str, Any]]]:
        return [st.stream(ids, p, stream=stream, logprob=body.logprobs, top_n=top_n) for p in choice_params]

    if not body.stream:
        results = await asyncio.gather(*[collect(s, request) for s in streams(False)])
        merged = [merge_pieces(r) for r in results]
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": r["text"]},
            "logprobs": _chat_logprobs(st, r["output_ids"], r["logprobs"], r["top_logprobs"]) if body.logprobs else None,
            "finish_reason": _finish(r["meta_info"]),
        } for i, r in enumerate(merged)]
        usage = _usage(len(ids), sum(r["meta_info"]["completion_tokens"] for r in merged),
                       merged[0]["meta_info"]["cached_tokens"])
        return ORJSONResponse({"id": cid, "object": "chat.completion", "created": created,
                               "model": model, "choices": choices, "usage": usage})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return _sse(obj)

    async def gen() -> AsyncIterator[bytes]:
        started = set()
        completion, cached = 0, 0
        async for i, piece in _fan_in(streams(True)):
            if i not in started:
                started.add(i)
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            meta = piece["meta_info"]
            finished = piece["finished"]
            if piece["text"] or finished:
                lp = (_chat_logprobs(st, piece["output_ids"], piece.get("logprobs") or [],
                                     piece.get("top_logprobs") or []) if body.logprobs else None)
                delta = {"content": piece["text"]} if piece["text"] else {}
                yield chunk([{"index": i, "delta": delta, "logprobs": lp,
                              "finish_reason": _finish(meta) if finished else None}])
            if finished:
                completion += meta["completion_tokens"]
                if i == 0:
                    cached = meta["cached_tokens"]
        if include_usage:
            yield chunk([], _usage(len(ids), completion, cached))
        yield b"data: [DONE]\n\n"

    return await _start_stream(gen())


def _completion_logprobs(st: ServerState, ids: list[int], lps: list[float], tops: list[Any], offset: int) -> dict[str, Any]:
    tokens = [_token_str(st, t) for t in ids]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{_token_str(st, int(t)): v for t, v in (tops[j] if j < len(tops) else [])}
                         for j in range(len(ids))],
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    st = _state(request)
    st.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise APIError("echo together with logprobs is not supported (no prompt logprobs)", 400, param="echo")
    sampling = body.sampling_dict(body.max_tokens)
    prepared = []
    for k, p in enumerate(body.prompts()):
        try:
            prepared.append(st.prepare(p if isinstance(p, str) else None,
                                       p if isinstance(p, list) else None, sampling, check_total=True))
        except ValueError as e:
            raise APIError(f"prompt {k}: {e}" if len(body.prompts()) > 1 else str(e), 400, param="prompt") from e
    want_lp = body.logprobs is not None
    top_n = body.logprobs or 0
    jobs = [(ids, cp) for ids, params in prepared for cp in _choice_params(params, body.n)]
    echo_text = [st.tokenizer.decode(ids) if body.echo else "" for ids, _ in jobs]
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), st.model_name

    def streams(stream: bool) -> list[AsyncIterator[dict[str, Any]]]:
        return [st.stream(ids, p, stream=stream, logprob=want_lp, top_n=top_n) for ids, p in jobs]

    prompt_tokens = sum(len(ids) for ids, _ in prepared)
    if not body.stream:
        results = [merge_pieces(r) for r in await asyncio.gather(*[collect(s, request) for s in streams(False)])]
        choices = [{
            "index": i,
            "text": echo_text[i] + r["text"],
            "logprobs": _completion_logprobs(st, r["output_ids"], r["logprobs"], r["top_logprobs"], 0) if want_lp else None,
            "finish_reason": _finish(r["meta_info"]),
        } for i, r in enumerate(results)]
        cached = sum(results[k * body.n]["meta_info"]["cached_tokens"] for k in range(len(prepared)))
        usage = _usage(prompt_tokens, sum(r["meta_info"]["completion_tokens"] for r in results), cached)
        return ORJSONResponse({"id": cid, "object": "text_completion", "created": created,
                               "model": model, "choices": choices, "usage": usage})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        obj = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return _sse(obj)

    async def gen() -> AsyncIterator[bytes]:
        completion, cached = 0, 0
        sent_echo: set[int] = set()
        text_pos = [0] * len(jobs)
        async for i, piece in _fan_in(streams(True)):
            text = piece["text"]
            if i not in sent_echo:
                sent_echo.add(i)
                text = echo_text[i] + text
            finished = piece["finished"]
            if text or finished:
                lp = (_completion_logprobs(st, piece["output_ids"], piece.get("logprobs") or [],
                                           piece.get("top_logprobs") or [], text_pos[i]) if want_lp else None)
                text_pos[i] += len(text)
                yield chunk([{"index": i, "text": text, "logprobs": lp,
                              "finish_reason": _finish(piece["meta_info"]) if finished else None}])
            if finished:
                completion += piece["meta_info"]["completion_tokens"]
                if i % body.n == 0:
                    cached += piece["meta_info"]["cached_tokens"]
        if include_usage:
            yield chunk([], _usage(prompt_tokens, completion, cached))
        yield b"data: [DONE]\n\n"

    return await _start_stream(gen())
