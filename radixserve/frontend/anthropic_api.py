"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A request is converted (``chat/anthropic.py``) into the fields of a ``/v1/chat/completions``
body and runs as that chat request (``chat_api.prepare_chat``): the same template, tool
planning and grammars, sampling checks, limits and output parsing.  Only the answer's shape is
Anthropic's: content blocks (``text``, ``tool_use``, ``thinking`` with a reasoning parser),
``stop_reason``, ``usage`` with the cache's numbers, and the stream's event sequence
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per block,
``message_delta``, ``message_stop``).  Errors on these paths are in Anthropic's shape
(``errors.error_payload``).

``cache_control`` breakpoints pin the prompt's prefix up to each breakpoint for its TTL once
the answer is generated (``cache_api.keep_warm``); ``usage.cache_read_input_tokens`` is what the
radix tree served, ``cache_creation_input_tokens`` what of the pinned prefixes it did not.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Request

from radixserve.cache.tree_node import common_len, pack_key
from radixserve.chat.anthropic import (
    CHOICE_NAMES,
    FIELD_RENAMES,
    CountTokensRequest,
    MessagesRequest,
    breakpoints,
    chat_fields,
    field_names,
)
from radixserve.chat.parsers import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)
from radixserve.frontend.cache_api import keep_warm
from radixserve.frontend.chat_api import ChatCall, chat_request, prepare_chat, prompt_ids
from radixserve.frontend.errors import APIError, anthropic_error_body, renamed
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.openai_common import server_state, start_stream, stream_failure
from radixserve.frontend.protocol import ChatCompletionRequest
from radixserve.frontend.state import ServerState, collect
from radixserve.runtime.pieces import Piece, RequestMeta, merge

router = APIRouter()


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _error_events(e: Exception) -> list[bytes]:
    message, status = stream_failure(e)
    return [_event("error", {"error": anthropic_error_body(message, status)["error"]})]


def _stop_reason(meta: RequestMeta, has_calls: bool) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` for a finished request."""
    reason = meta.finish_reason
    if reason is not None and reason.type == "length":  # a call cut off is no call to make
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if reason is not None and isinstance(reason.matched, str):
        return "stop_sequence", reason.matched
    return "end_turn", None


def _pin_prefixes(st: ServerState, chat: ChatCompletionRequest, ids: list[int],
                  marks: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Each breakpoint's prefix of ``ids`` as ``(tokens, ttl)``: where the prompt rendered
    from the breakpoint's first messages (without a generation prompt) stops agreeing."""
    out = []
    for count, ttl in marks:
        partial = chat.model_copy(update={"messages": chat.messages[:count],
                                          "add_generation_prompt": False})
        head = prompt_ids(st, partial)
        n = min(len(head), len(ids))
        tokens = common_len(pack_key(head, n), pack_key(ids, n))  # the radix tree's comparison
        if tokens:
            out.append((tokens, ttl))
    return out


@dataclass
class _MessagesCall:
    call: ChatCall
    pins: list[tuple[int, float]]  # (prefix tokens, ttl seconds) per cache_control breakpoint
    mid: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:24]}")

    def usage(self, meta: RequestMeta) -> dict[str, int]:
        """Anthropic's usage: ``input_tokens`` are those neither read from the cache nor
        written for a breakpoint; the three add up to the prompt."""
        cached = meta.cached_tokens
        creation = max(0, max((k for k, _ in self.pins), default=0) - cached)
        return {"input_tokens": len(self.call.ids) - cached - creation,
                "output_tokens": meta.completion_tokens,
                "cache_creation_input_tokens": creation, "cache_read_input_tokens": cached}

    async def keep_pins(self) -> None:
        namespace = self.call.body.cache_salt or ""
        lora = self.call.st.adapter_of(self.call.body.model)
        for tokens, ttl in self.pins:
            await keep_warm(self.call.st, self.call.ids[:tokens], namespace, ttl, lora)

    def head(self) -> dict[str, Any]:
        return {"id": self.mid, "type": "message", "role": "assistant",
                "model": self.call.st.model_name}


def _prepare(st: ServerState, body: MessagesRequest) -> _MessagesCall:
    st.check_model(body.model)
    try:
        chat = chat_request(chat_fields(body))
        call = prepare_chat(st, chat)
        return _MessagesCall(call, _pin_prefixes(st, chat, call.ids, breakpoints(body)))
    except APIError as e:  # about the chat request: name the Messages field
        raise renamed(e, field_names(body), FIELD_RENAMES, CHOICE_NAMES) from None


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Any:
    mc = _prepare(server_state(request), body)
    if not body.stream:
        return await _message_response(mc, request)
    return await start_stream(_message_events(mc), _error_events)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONBytesResponse:
    """The prompt's tokens, whatever their number (the body size limit still applies)."""
    st = server_state(request)
    st.check_model(body.model)
    try:
        ids = prompt_ids(st, chat_request(chat_fields(body)))
    except APIError as e:
        raise renamed(e, field_names(body), FIELD_RENAMES, CHOICE_NAMES) from None
    return JSONBytesResponse({"input_tokens": len(ids)})


def _tool_use(cid: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block; arguments that are not a JSON object (a call the model broke off
    without a grammar) stay text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        return {"type": "text", "text": arguments}
    return {"type": "tool_use", "id": cid, "name": name, "input": value}


def _blocks(parsed: ParsedMessage) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if parsed.reasoning_content:
        out.append({"type": "thinking", "thinking": parsed.reasoning_content, "signature": ""})
    if parsed.content:
        out.append({"type": "text", "text": parsed.content})
    out += [_tool_use(cid, c.name, c.arguments) for cid, c in parsed.tool_calls]
    return out or [{"type": "text", "text": ""}]


async def _message_response(mc: _MessagesCall, request: Request) -> JSONBytesResponse:
    call = mc.call
    r = merge(await collect(call.streams(False)[0], request))
    parsed = (call.spec.new_parser(tool_use_id).parse(r.text) if call.spec.active
              else ParsedMessage(r.text, None, []))
    content = _blocks(parsed)
    reason, sequence = _stop_reason(r.meta, any(b["type"] == "tool_use" for b in content))
    await mc.keep_pins()
    return JSONBytesResponse({**mc.head(), "content": content, "stop_reason": reason,
                              "stop_sequence": sequence, "usage": mc.usage(r.meta)})


class _BlockStream:
    """Parsed pieces as Anthropic's content block events: a block opens when the kind of
    piece changes (text, thinking) or a tool call starts, and closes before the next."""

    _KINDS = {ContentDelta: "text", ReasoningDelta: "thinking", ToolCallStart: "tool_use"}

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.has_calls = False

    def add(self, p: Delta) -> list[bytes]:
        if isinstance(p, ToolArgsDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": p.text})]
        if isinstance(p, ContentDelta | ReasoningDelta) and not p.text:
            return []
        kind = self._KINDS[type(p)]
        out = []
        if kind != self.kind or isinstance(p, ToolCallStart):
            out += self.close()
            out.append(self._open(p, kind))
        if isinstance(p, ContentDelta):
            out.append(self._delta({"type": "text_delta", "text": p.text}))
        elif isinstance(p, ReasoningDelta):
            out.append(self._delta({"type": "thinking_delta", "thinking": p.text}))
        return out

    def _open(self, p: Delta, kind: str) -> bytes:
        self.index += 1
        self.kind = kind
        block: dict[str, Any] = {"type": "text", "text": ""}
        if isinstance(p, ToolCallStart):
            self.has_calls = True
            block = {"type": "tool_use", "id": p.id, "name": p.name, "input": {}}
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        return _event("content_block_start", {"index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def finish(self) -> list[bytes]:
        """Close the last block; an answer without any gets one empty text block."""
        if self.index < 0:
            return [self._open(ContentDelta(""), "text"), *self.close()]
        return self.close()


async def _message_events(mc: _MessagesCall) -> AsyncIterator[bytes]:
    stream = mc.call.streams(True)[0]
    try:
        async for event in _events_of(mc, stream):
            yield event
    finally:
        await stream.aclose()  # a reader gone mid-stream aborts the request


async def _events_of(mc: _MessagesCall, stream: AsyncIterator[Piece]) -> AsyncIterator[bytes]:
    call = mc.call
    parser = call.spec.new_parser(tool_use_id) if call.spec.active else None
    blocks = _BlockStream()
    started = False
    async for piece in stream:
        if not started:
            started = True
            usage = {**mc.usage(piece.meta), "output_tokens": 0}
            yield _event("message_start", {"message": {
                **mc.head(), "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage}})
        if parser is not None:
            pieces = parser.feed(piece.text) + (parser.finish() if piece.finished else [])
        else:
            pieces = [ContentDelta(piece.text)]
        for p in pieces:
            for event in blocks.add(p):
                yield event
        if piece.finished:
            for event in blocks.finish():
                yield event
            await mc.keep_pins()
            reason, sequence = _stop_reason(piece.meta, blocks.has_calls)
            yield _event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": mc.usage(piece.meta)})
            yield _event("message_stop", {})
