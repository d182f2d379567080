"""A Responses API answer's output items, whole or as the stream's events.

Items: ``reasoning`` (with a reasoning parser), ``message`` (one ``output_text`` part) and one
``function_call`` per call, in the order the model wrote them.  The stream opens an item when
the kind of parsed piece changes or a call starts, and sends per item ``output_item.added``,
its deltas (``output_text.delta``, ``function_call_arguments.delta``,
``reasoning_text.delta``), their ``.done`` events and ``output_item.done``; every event
carries a ``sequence_number``.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from radixserve.chat.parsers import (
    ContentDelta,
    Delta,
    OutputParser,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
)
from radixserve.runtime.pieces import Piece


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _needs_message(calls: bool, reasoning: bool, cut_off: bool) -> bool:
    """Whether an answer without text still ends with an (empty) message item: unless it made
    tool calls, or was cut off in its reasoning (then the reasoning item is the answer, as
    OpenAI's).  A finished answer has one, so that an agent SDK reads its final output."""
    return not calls and not (reasoning and cut_off)


def output_items(text: str, parsed: ParsedMessage | None, cut_off: bool = False
                 ) -> list[dict[str, Any]]:
    """The items of a whole answer (``parsed`` None: no tool or reasoning parsing); with
    ``cut_off`` (``max_output_tokens`` ended it) the last item is ``incomplete``.  The same
    items as :class:`ItemStream` streams (:func:`_needs_message`)."""
    if parsed is None:
        out = [message_item(text)]
    else:
        out = [reasoning_item(parsed.reasoning_content)] if parsed.reasoning_content else []
        if parsed.content or _needs_message(bool(parsed.tool_calls), bool(out), cut_off):
            out.append(message_item(parsed.content or ""))
        out += [call_item(cid, c.name, c.arguments) for cid, c in parsed.tool_calls]
    if cut_off and "status" in out[-1]:
        out[-1]["status"] = "incomplete"
    return out


class ItemStream:
    """One streamed answer's events; ``output`` holds the finished items."""

    def __init__(self, parser: OutputParser | None) -> None:
        self.parser = parser
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.item: dict[str, Any] | None = None  # the open item
        self.text: list[str] = []  # its text or arguments so far

    def event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def feed(self, piece: Piece) -> list[bytes]:
        if self.parser is None:
            pieces: list[Delta] = [ContentDelta(piece.text)]
        else:
            pieces = self.parser.feed(piece.text)
            if piece.finished:
                pieces += self.parser.finish()
        out = [e for p in pieces for e in self._add(p)]
        if piece.finished:
            cut = piece.meta.finish_type == "length"
            kinds = {item["type"] for item in [*self.output, *([self.item] if self.item else [])]}
            if "message" not in kinds and _needs_message("function_call" in kinds,
                                                         "reasoning" in kinds, cut):
                out += self.close()
                out.append(self._open(message_item("", "in_progress")))
            out += self.close("incomplete" if cut else "completed")
        return out

    def _add(self, p: Delta) -> list[bytes]:
        if isinstance(p, ToolArgsDelta):
            self.text.append(p.text)
            return [self._delta("response.function_call_arguments.delta", p.text)]
        if isinstance(p, ContentDelta | ReasoningDelta) and not p.text:
            return []
        out = []
        kind = {ContentDelta: "message", ReasoningDelta: "reasoning",
                ToolCallStart: "function_call"}[type(p)]
        if self.item is None or self.item["type"] != kind or isinstance(p, ToolCallStart):
            out += self.close()
            if isinstance(p, ToolCallStart):
                out.append(self._open(call_item(p.id, p.name, "", "in_progress")))
            elif kind == "reasoning":
                out.append(self._open({**reasoning_item(""), "content": []}))
            else:
                out.append(self._open(message_item("", "in_progress")))
        if isinstance(p, ContentDelta | ReasoningDelta):
            self.text.append(p.text)
            name = ("response.output_text.delta" if kind == "message"
                    else "response.reasoning_text.delta")
            out.append(self._delta(name, p.text))
        return out

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _delta(self, kind: str, text: str) -> bytes:
        extra = {} if kind.startswith("response.function_call") else {"content_index": 0}
        return self.event(kind, **self._where(), **extra, delta=text)

    def _open(self, item: dict[str, Any]) -> bytes:
        self.item, self.text = item, []
        out = self.event("response.output_item.added", output_index=len(self.output), item=item)
        if item["type"] == "message":
            out += self.event("response.content_part.added", **self._where(), content_index=0,
                              part=_text_part(""))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """Finish the open item (``status``: ``incomplete`` when the answer was cut off in it):
        its ``.done`` events, and it joins ``output``."""
        item = self.item
        if item is None:
            return []
        text = "".join(self.text)
        where = self._where()
        out = []
        if item["type"] == "message":
            item = {**item, "status": status, "content": [_text_part(text)]}
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=_text_part(text)))
        elif item["type"] == "function_call":
            item = {**item, "status": status, "arguments": text}
            out.append(self.event("response.function_call_arguments.done", **where,
                                  arguments=text))
        else:
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=text))
        out.append(self.event("response.output_item.done", output_index=len(self.output),
                              item=item))
        self.output.append(item)
        self.item, self.text = None, []
        return out
