"""SGLang-style native routes: /generate, /health, /health_generate, /server_info,
/flush_cache, /abort_request, and /metrics."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from radixserve import __version__
from radixserve.frontend.errors import APIError
from radixserve.frontend.openai_common import SSE_DONE, guarded_stream
from radixserve.frontend.protocol import AbortRequest, GenerateRequest
from radixserve.frontend.responses import JSONBytesResponse
from radixserve.frontend.serving import ServerState, collect, merge_pieces
from radixserve.frontend.tokenizer_manager import RequestError

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 30.0


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _result(r: dict[str, Any]) -> dict[str, Any]:
    meta = dict(r["meta_info"])
    if r.get("logprobs"):
        meta.update(output_token_logprobs=r["logprobs"], output_top_logprobs=r["top_logprobs"])
    if "input_logprobs" in r:  # logprob_start_len >= 0: prompt positions from it on
        meta.update(input_token_logprobs=r["input_logprobs"], input_top_logprobs=r["input_top_logprobs"])
    return {"text": r["text"], "output_ids": r["output_ids"], "meta_info": meta}


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    st = _state(request)
    batched = isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))
    texts = body.text if isinstance(body.text, list) else [body.text] if body.text is not None else None
    ids_list = (body.input_ids if batched else [body.input_ids]) if body.input_ids is not None else None
    n = len(texts) if texts is not None else len(ids_list)
    if n == 0:
        raise APIError("the batch is empty", 400, param="text")
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * n
    if len(sps) != n:
        raise APIError(f"{len(sps)} sampling_params for {n} prompts", 400, param="sampling_params")
    prepared = []
    for i in range(n):
        try:
            prepared.append(st.prepare(texts[i] if texts else None, ids_list[i] if ids_list else None, sps[i],
                                       logprob_start_len=body.logprob_start_len,
                                       prompt_param="text" if texts else "input_ids"))
        except APIError as e:
            if batched:
                e.message = f"request {i}: {e.message}"
            raise
    if body.stream:
        if batched:
            raise APIError("stream=true takes a single prompt", 400, param="stream")
        ids, params = prepared[0]
        pieces = st.stream(ids, params, stream=True, logprob=body.return_logprob,
                           top_n=body.top_logprobs_num, rid=body.rid,
                           logprob_start_len=body.logprob_start_len)
        it = pieces.__aiter__()
        first = await it.__anext__()  # errors answer with their status before streaming

        async def rest() -> AsyncIterator[bytes]:
            # Each event carries the text and ids so far (SGLang's native stream format).
            acc: list[dict[str, Any]] = [first]
            try:
                async for piece in it:
                    acc.append(piece)
                    yield b"data: " + orjson.dumps(_result(merge_pieces(acc))) + b"\n\n"
            finally:
                await it.aclose()  # the request is aborted if the stream stops early
            yield SSE_DONE

        first_event = b"data: " + orjson.dumps(_result(merge_pieces([first]))) + b"\n\n"
        return StreamingResponse(guarded_stream(first_event, rest()), media_type="text/event-stream")
    rids = [body.rid if not batched else None] * n
    results = await asyncio.gather(*[
        collect(st.stream(ids, params, stream=False, logprob=body.return_logprob,
                          top_n=body.top_logprobs_num, rid=rids[i],
                          logprob_start_len=body.logprob_start_len), request)
        for i, (ids, params) in enumerate(prepared)
    ])
    out = [_result(merge_pieces(r)) for r in results]
    return JSONBytesResponse(out if batched else out[0])


@router.get("/health")
async def health(request: Request) -> Response:
    st = _state(request)
    if st.tm.dead_reason or st.shutting_down:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    st = _state(request)
    try:
        ids, params = st.tm.prepare(None, [st.info["eos_token_ids"][0] if st.info["eos_token_ids"] else 0],
                                    {"max_new_tokens": 1, "temperature": 0})
        await asyncio.wait_for(collect(st.stream(ids, params, stream=False), request), HEALTH_GENERATE_TIMEOUT_S)
    except (RequestError, TimeoutError) as e:
        return JSONBytesResponse({"status": "unhealthy", "error": str(e)}, 503)
    return Response(status_code=200)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> JSONBytesResponse:
    st = _state(request)
    stats = await st.tm.control("stats")
    memory = await st.tm.control("check_memory")
    args = st.args.to_dict()
    args.pop("api_key", None)
    return JSONBytesResponse({
        "version": __version__,
        "model": st.model_name,
        "server_args": args,
        "model_info": st.info,
        "stats": stats,
        "memory": memory,
        "pids": {"server": os.getpid(), **st.pids},
    })


@router.post("/flush_cache")
async def flush_cache(request: Request) -> JSONBytesResponse:
    st = _state(request)
    result = await st.tm.control("flush_cache")
    if not result.get("success"):
        raise APIError("cannot flush the cache while requests are running", 409)
    return JSONBytesResponse({"success": True, "message": "cache flushed"})


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> JSONBytesResponse:
    await _state(request).tm.abort(body.rid)
    return JSONBytesResponse({"success": True})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = _state(request)
    stats = await st.tm.control("stats")
    stats["page_size"] = st.info.get("page_size", 1)
    return Response(st.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")
