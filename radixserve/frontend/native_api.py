"""SGLang-style native routes: /generate, /health, /health_generate, /server_info,
/get_model_info, /get_load, /v1/loads, /flush_cache, /abort_request, /concate_and_append_request,
/metrics, and radixserve's /apply_chat_template.  Together they are what SGLang's frontend language
(``sglang.RuntimeEndpoint``) and the routers (smg and ``sglang-router``: /health, /server_info,
/model_info, /get_load or /v1/loads, /flush_cache, /metrics) call."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from radixserve import __version__
from radixserve.chat.messages import ApplyChatTemplateRequest
from radixserve.chat.render import ChatTemplateError, render_without_tools
from radixserve.frontend.errors import APIError
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.loads import load_snapshot, loads_document, parse_include
from radixserve.frontend.native_protocol import AbortRequest, GenerateRequest
from radixserve.frontend.openai_common import SSE_DONE, guarded_stream
from radixserve.frontend.state import ServerState, collect
from radixserve.runtime.jobs import PromptSpec, prepare_jobs, split_batch
from radixserve.runtime.native_output import LogprobRequest, NativeOutput
from radixserve.runtime.pieces import Piece
from radixserve.runtime.tokenizer_manager import InvalidRequestError, RequestError
from radixserve.sampling import SamplingParams
from radixserve.settings.kv_events_config import KVEventsConfig

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 30.0


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _event(result: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(result) + b"\n\n"


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    st = _state(request)
    adapters = body.lora_path if isinstance(body.lora_path, list) else [body.lora_path]
    loras = [st.check_model(body.model, a) for a in adapters]
    lp = LogprobRequest(body.return_logprob, body.top_logprobs_num, body.logprob_start_len,
                        body.return_text_in_logprobs)
    prompt_param = "text" if body.text is not None else "input_ids"
    try:
        batched, specs = split_batch(
            body.text, body.input_ids, body.sampling_params, body.extra_key,
            priority=body.priority or 0, cache_report=body.return_cache_report,
            bootstrap=(body.bootstrap_host, body.bootstrap_port, body.bootstrap_room),
            lora_path=loras if isinstance(body.lora_path, list) else loras[0],
        )
    except InvalidRequestError as e:
        raise APIError(str(e), 400, param=e.param) from None

    def prepare(spec: PromptSpec) -> tuple[list[int], SamplingParams]:
        return st.prepare(spec.text, spec.input_ids, spec.sampling,
                          logprob_start_len=body.logprob_start_len, prompt_param=prompt_param)

    jobs = prepare_jobs(specs, batched, prepare)

    def pieces(i: int, stream: bool, rid: str | None) -> AsyncIterator[Piece]:
        job = jobs[i]
        return st.stream(job.ids, job.params, stream=stream, logprob=lp.return_logprob,
                         top_n=lp.top_logprobs_num, rid=rid,
                         logprob_start_len=lp.scheduler_start(len(job.ids)), hints=job.hints)

    if body.stream:
        if batched:
            raise APIError("stream=true takes a single prompt", 400, param="stream")
        out = NativeOutput(jobs[0].ids, lp, st.tokenizer)
        it = pieces(0, True, body.rid).__aiter__()
        out.add(await it.__anext__())  # errors answer with their status before streaming

        async def rest() -> AsyncIterator[bytes]:
            # Each event carries the text, ids and logprobs so far (SGLang's native stream format).
            try:
                async for piece in it:
                    out.add(piece)
                    yield _event(out.result())
            finally:
                await it.aclose()  # the request is aborted if the stream stops early
            yield SSE_DONE

        return StreamingResponse(guarded_stream(_event(out.result()), rest()),
                                 media_type="text/event-stream")
    results = await asyncio.gather(*[
        collect(pieces(i, False, None if batched else body.rid), request) for i in range(len(jobs))
    ])
    outs = []
    for job, result in zip(jobs, results, strict=True):
        out = NativeOutput(job.ids, lp, st.tokenizer)
        for piece in result:
            out.add(piece)
        outs.append(out.result())
    return JSONBytesResponse(outs if batched else outs[0])


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
        ids, params = st.tm.prepare(
            None, [st.info.eos_token_ids[0] if st.info.eos_token_ids else 0],
            {"max_new_tokens": 1, "temperature": 0},
        )
        await asyncio.wait_for(collect(st.stream(ids, params, stream=False), request),
                               HEALTH_GENERATE_TIMEOUT_S)
    except (RequestError, TimeoutError) as e:
        return JSONBytesResponse({"status": "unhealthy", "error": str(e)}, 503)
    return Response(status_code=200)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> JSONBytesResponse:
    st = _state(request)
    stats = await st.tm.control("stats")
    memory = await st.tm.control("check_memory")
    pins = await st.tm.control("pins")
    args = st.args.to_dict()
    args.pop("api_key", None)
    return JSONBytesResponse({
        "version": __version__,
        "model": st.model_name,
        # SGLang's top-level keys (its /server_info is its server arguments and scheduler
        # info, flattened), the ones SGLang's router registers a worker with among them.
        "model_path": st.model_path,
        "tokenizer_path": st.info.tokenizer_path,
        "served_model_name": st.model_name,
        "tp_size": st.info.tp_size,
        "dp_size": 1,
        "context_length": st.info.context_length,
        "page_size": st.info.page_size,
        "max_total_num_tokens": st.info.max_total_tokens,
        "max_running_requests": st.info.max_running_requests,
        "speculative_algorithm": st.info.speculative_algorithm,
        # Where a KV-aware router subscribes to this worker's KV events (SGLang's descriptor).
        "kv_events": KVEventsConfig.of(st.args.kv_events_config).describe(st.info.page_size),
        "server_args": args,
        "model_info": st.info.to_dict(),
        "stats": stats,
        "memory": memory,
        "pins": pins,
        "pids": {"server": os.getpid(), **st.pids},
    })


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> JSONBytesResponse:
    """SGLang's model description (``RuntimeEndpoint`` reads ``model_path`` to pick its chat
    template), plus radixserve's own fields."""
    st = _state(request)
    hf = hf_config(st.model_path)
    return JSONBytesResponse({
        "model_path": st.model_path,
        "tokenizer_path": st.info.tokenizer_path,
        "is_generation": True,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "served_model_name": st.model_name,
        "context_length": st.info.context_length,
        "vocab_size": st.info.vocab_size,
        "eos_token_ids": st.info.eos_token_ids,
        "has_chat_template": bool(getattr(st.tokenizer, "chat_template", None)),
    })


@functools.lru_cache(maxsize=4)
def hf_config(model_path: str) -> dict[str, Any]:
    """The model folder's ``config.json`` (empty for a GGUF file, or a folder without one)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


@router.get("/get_load")
async def get_load(request: Request) -> JSONBytesResponse:
    """SGLang's load report, one entry per data-parallel rank (a radixserve server is one):
    requests in flight, of them waiting in the scheduler's queue, and the tokens of those in
    flight (prompt plus output so far).  SGLang's router reads ``num_tokens``."""
    st = _state(request)
    stats = await st.tm.control("stats")
    return JSONBytesResponse([{
        "dp_rank": 0,
        "num_reqs": st.inflight_requests,
        "num_waiting_reqs": stats.get("waiting", 0),
        "num_tokens": st.inflight_tokens,
    }])


@router.get("/v1/loads")
async def v1_loads(request: Request, include: str | None = None) -> JSONBytesResponse:
    """SGLang's load snapshots (``frontend/loads.py``), which smg's load monitor polls."""
    st = _state(request)
    try:
        sections = parse_include(include)
    except ValueError as e:
        raise APIError(str(e), 400, param="include") from None
    stats = await st.tm.control("stats")
    rate = st.gen_rate.update(stats["generation_tokens"])
    return JSONBytesResponse(loads_document([load_snapshot(stats, st.info, sections, rate)]))


@router.post("/apply_chat_template")
async def apply_chat_template(
    body: ApplyChatTemplateRequest, request: Request
) -> JSONBytesResponse:
    """The prompt text ``/v1/chat/completions`` renders for these messages without tools, and
    its token count (generating from it with ``/generate`` reuses what the chat route cached)."""
    st = _state(request)
    try:
        text = render_without_tools(st.tokenizer, st.args.tool_call_parser, body)
    except ChatTemplateError as e:
        raise APIError(str(e), 400, param=e.param) from e
    num_tokens = len(st.tokenizer.encode(text, add_special_tokens=False))
    return JSONBytesResponse({"text": text, "num_tokens": num_tokens})


@router.post("/concate_and_append_request")
async def concate_and_append_request(request: Request) -> JSONBytesResponse:
    """SGLang's frontend calls this after a fork, to append the branches' KV to the parent
    request.  Nothing to do here: the client has already appended the branches' text to its
    own prompt and sends the whole text with its next call, whose prefix the radix tree
    serves from what the branches cached (or recomputes what it evicted)."""
    return JSONBytesResponse({"success": True})


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
    stats["page_size"] = st.info.page_size
    return Response(st.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")
