"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``.

A request's conversation (a stored response's, with ``previous_response_id``, then its
``input`` items) is converted (``chat/responses.py``) into the fields of a
``/v1/chat/completions`` body and runs as that chat request (``chat_api.prepare_chat``): the
same template, tool planning and grammars, sampling checks, limits and output parsing.  The
answer's shape is the Responses API's: output items (``message`` with ``output_text``,
``function_call``, ``reasoning`` with a reasoning parser), ``status``, ``usage`` with
``input_tokens_details.cached_tokens`` from the radix tree, and the stream's events
(``response_items.py``).

With ``store`` (the default), the response and its conversation are kept in the in-memory
store (``response_store.py``, per tenant) and the conversation's tokens are pinned in the
radix tree for ``--response-pin-ttl`` seconds, so the next turn (after a tool call, however
long the tool takes and whatever else the server computes meanwhile) reads them from the cache.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from radixserve.chat.parsers.reasoning import THINK_END
from radixserve.chat.responses import (
    FIELD_RENAMES,
    ResponsesRequest,
    assistant_message,
    chat_fields,
    conversation,
    field_names,
)
from radixserve.frontend.cache_api import keep_warm
from radixserve.frontend.chat_api import (
    ChatCall,
    KnownPrefix,
    chat_request,
    known_prefix,
    prepare_chat,
)
from radixserve.frontend.errors import APIError, renamed
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.openai_common import server_state, start_stream, stream_failure
from radixserve.frontend.response_items import ItemStream, output_items
from radixserve.frontend.response_store import StoredResponse, tenant
from radixserve.frontend.state import ServerState, collect
from radixserve.runtime.pieces import RequestMeta, merge

router = APIRouter()


def _status(meta: RequestMeta) -> tuple[str, dict[str, str] | None]:
    kind = meta.finish_type
    if kind == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return ("cancelled" if kind == "abort" else "completed"), None


@dataclass
class _ResponsesCall:
    st: ServerState
    body: ResponsesRequest
    namespace: str  # the tenant: API key and cache salt
    messages: list[dict[str, Any]]  # the conversation, previous turns included
    origins: list[tuple[int, ...]]  # per message, the input items it holds
    known: KnownPrefix | None  # the previous turn's tokens (prompt + output)
    rid: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    call: ChatCall = field(init=False)

    def __post_init__(self) -> None:
        fields = chat_fields(self.body, self.messages)
        try:
            self.call = prepare_chat(self.st, chat_request({**fields, "rid": self.rid}),
                                     self.known)
        except APIError as e:  # about the chat request: name the Responses field
            raise renamed(e, field_names(self.body, self.origins), FIELD_RENAMES) from None

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 incomplete: dict[str, str] | None = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.st.model_name, "output": output, "error": None,
            "incomplete_details": incomplete, "instructions": b.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "tool_choice": (b.tool_choice if isinstance(b.tool_choice, str | None)
                            else b.tool_choice.model_dump()) or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature, "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id, "store": b.store,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "metadata": b.metadata or {},
            "usage": usage,
        }

    def usage(self, meta: RequestMeta, output_ids: list[int],
              output: list[dict[str, Any]]) -> dict[str, Any]:
        prompt, generated = len(self.call.ids), meta.completion_tokens
        reasoning = _reasoning_tokens(self.st.tokenizer, output_ids, output)
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": meta.cached_tokens},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + generated}

    async def finish(self, meta: RequestMeta, output_ids: list[int],
                     output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response (``output_ids``: every token it generated); stored, with its
        conversation pinned, when asked."""
        status, incomplete = _status(meta)
        response = self.response(status, output, self.usage(meta, output_ids, output), incomplete)
        if self.body.store:
            await self._store(response, output_ids)
        return response

    async def _store(self, response: dict[str, Any], output_ids: list[int]) -> None:
        st = self.st
        text = "".join(p["text"] for item in response["output"] if item["type"] == "message"
                       for p in item["content"])
        calls = [(i["call_id"], i["name"], i["arguments"]) for i in response["output"]
                 if i["type"] == "function_call"]
        reasoning = "".join(p["text"] for item in response["output"]
                            if item["type"] == "reasoning" for p in item["content"])
        turn = list(self.messages)  # without the instructions: they are not carried over
        ids = self.call.ids + output_ids
        pinned = st.args.response_pin_ttl > 0
        salt = self.body.cache_salt or ""
        lora = st.adapter_of(self.body.model)
        entry = StoredResponse(response, [*turn, assistant_message(text, calls, reasoning)],
                               ids, pinned, salt, lora)
        if pinned:
            await keep_warm(st, ids, salt, st.args.response_pin_ttl, lora)
        for gone in st.responses.put(self.namespace, self.rid, entry):
            await _unpin(st, gone)


def _reasoning_tokens(tokenizer: Any, output_ids: list[int], output: list[dict[str, Any]]) -> int:
    """The output tokens of the reasoning block (a ``reasoning`` item, from the reasoning
    parser): those up to the one that completes ``</think>``, or all of them when the block
    never closed (cut off).  Found by decoding prefixes (a binary search), so a closing tag of
    several tokens counts as one of one."""
    if not any(item["type"] == "reasoning" for item in output):
        return 0

    def closed(n: int) -> bool:
        return THINK_END in tokenizer.decode(output_ids[:n], skip_special_tokens=False)

    if not closed(len(output_ids)):
        return len(output_ids)
    low, high = 1, len(output_ids)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if closed(mid) else (mid + 1, high)
    return low


async def _unpin(st: ServerState, entry: StoredResponse) -> None:
    if entry.pinned:
        await st.tm.control("unpin", input_ids=entry.ids, extra_key=entry.salt, lora=entry.lora)


def _prepare(st: ServerState, body: ResponsesRequest, request: Request) -> _ResponsesCall:
    st.check_model(body.model)
    namespace = tenant(request, body.cache_salt)
    earlier: list[dict[str, Any]] = []
    known = None
    if body.previous_response_id is not None:
        prev = st.responses.get(namespace, body.previous_response_id)
        if prev is None:
            raise APIError(f"no stored response has the id '{body.previous_response_id}'", 400,
                           param="previous_response_id")
        earlier = prev.messages
        known = known_prefix(st, prev.ids) if prev.ids else None
    try:
        messages, origins = conversation(body.items(), earlier)
    except ValueError as e:
        raise APIError(str(e), 400, param="input") from None
    return _ResponsesCall(st, body, namespace, messages, origins, known)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    rc = _prepare(server_state(request), body, request)
    if not body.stream:
        return await _running(rc, _respond(rc, request))
    items = ItemStream(rc.call.spec.new_parser() if rc.call.spec.active else None)
    return await start_stream(_running_stream(rc, items), _failure_events(rc, items))


async def _running(rc: _ResponsesCall, work: Any) -> Any:
    """``work``, with the response registered as running (so that it can be cancelled)."""
    key = (rc.namespace, rc.rid)
    rc.st.responses.running.add(key)
    try:
        return await work
    finally:
        rc.st.responses.running.discard(key)


async def _respond(rc: _ResponsesCall, request: Request) -> JSONBytesResponse:
    call = rc.call
    r = merge(await collect(call.streams(False)[0], request))
    parsed = call.spec.new_parser().parse(r.text) if call.spec.active else None
    output = output_items(r.text, parsed, cut_off=r.meta.finish_type == "length")
    return JSONBytesResponse(await rc.finish(r.meta, r.output_ids, output))


_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete",
             "cancelled": "response.failed"}


async def _running_stream(rc: _ResponsesCall, items: ItemStream) -> AsyncIterator[bytes]:
    """The stream's events.  ``response.created`` waits for the first generated piece, so
    that a request the runtime refuses (a grammar that does not compile) is answered with
    its 4xx status instead of a stream (``start_stream`` runs to the first event)."""
    key = (rc.namespace, rc.rid)
    rc.st.responses.running.add(key)
    stream = rc.call.streams(True)[0]
    try:
        started = False
        output_ids: list[int] = []  # a streamed piece holds only its new tokens
        async for piece in stream:
            if not started:
                started = True
                yield items.event("response.created", response=rc.response("in_progress", []))
                yield items.event("response.in_progress",
                                  response=rc.response("in_progress", []))
            output_ids += piece.output_ids
            for event in items.feed(piece):
                yield event
            if piece.finished:
                response = await rc.finish(piece.meta, output_ids, items.output)
                yield items.event(_TERMINAL[response["status"]], response=response)
    finally:
        rc.st.responses.running.discard(key)
        await stream.aclose()  # a reader gone mid-stream aborts the request


def _failure_events(rc: _ResponsesCall, items: ItemStream
                    ) -> Callable[[Exception], list[bytes]]:
    """The events that end a stream which failed after it started, in the Responses API's
    shape: an ``error`` event, then ``response.failed`` with the response's ``error``."""

    def events(e: Exception) -> list[bytes]:
        message, status = stream_failure(e)
        code = "server_error" if status >= 500 else "invalid_prompt"
        failed = {**rc.response("failed", items.output),
                  "error": {"code": code, "message": message}}
        return [items.event("error", code=code, message=message, param=None),
                items.event("response.failed", response=failed)]

    return events


def _stored(request: Request, response_id: str, cache_salt: str | None) -> StoredResponse:
    entry = server_state(request).responses.get(tenant(request, cache_salt), response_id)
    if entry is None:
        raise APIError(f"no stored response has the id '{response_id}'", 404)
    return entry


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request,
                       cache_salt: str | None = None) -> JSONBytesResponse:
    return JSONBytesResponse(_stored(request, response_id, cache_salt).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request,
                          cache_salt: str | None = None) -> JSONBytesResponse:
    st = server_state(request)
    _stored(request, response_id, cache_salt)
    entry = st.responses.pop(tenant(request, cache_salt), response_id)
    if entry is not None:
        await _unpin(st, entry)
    return JSONBytesResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request,
                          cache_salt: str | None = None) -> JSONBytesResponse:
    """Abort a response being generated; its client's answer ends with ``cancelled``."""
    st = server_state(request)
    namespace = tenant(request, cache_salt)
    if (namespace, response_id) in st.responses.running:
        await st.tm.abort(response_id)
        return JSONBytesResponse({"id": response_id, "object": "response",
                                  "status": "cancelled", "output": [],
                                  "model": st.model_name})
    _stored(request, response_id, cache_salt)  # 404 when unknown to this tenant
    raise APIError(f"the response '{response_id}' is not being generated; only a running "
                   "response can be cancelled", 400)
