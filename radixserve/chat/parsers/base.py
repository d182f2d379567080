"""What the output parsers emit: typed pieces of an assistant message, and their assembly.

A streaming parser turns text deltas into a list of pieces; the non-streaming result is the
same parser fed the whole text at once, assembled by :func:`assemble`.  So streaming and
non-streaming agree by construction, and the tests check that the pieces do not depend on
how the text was cut into deltas.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def marker_overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``: the
    text a streaming parser must hold back because the marker may be starting there."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ToolCallParsed:
    name: str
    arguments: str  # JSON text, exactly as the model wrote it


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A new tool call: its index in the message, id and function name (arguments follow)."""

    index: int
    id: str
    name: str

    def to_openai(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": ""}}


@dataclass(frozen=True)
class ToolArgsDelta:
    """The next fragment of tool call ``index``'s arguments JSON."""

    index: int
    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": self.text}}


Delta = ContentDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # None when empty
    reasoning_content: str | None  # None when there was no reasoning
    tool_calls: list[tuple[str, ToolCallParsed]]  # (id, call)

    @property
    def calls(self) -> list[ToolCallParsed]:
        return [call for _, call in self.tool_calls]


def assemble(pieces: list[Delta]) -> ParsedMessage:
    """Join pieces into one message (the non-streaming view of the same output)."""
    content: list[str] = []
    reasoning: list[str] = []
    ids: list[str] = []
    names: list[str] = []
    args: list[list[str]] = []
    for p in pieces:
        if isinstance(p, ContentDelta):
            content.append(p.text)
        elif isinstance(p, ReasoningDelta):
            reasoning.append(p.text)
        elif isinstance(p, ToolCallStart):
            if p.index != len(ids):
                raise ValueError(f"tool call {p.index} started out of order")
            ids.append(p.id)
            names.append(p.name)
            args.append([])
        else:
            args[p.index].append(p.text)
    calls = [(i, ToolCallParsed(n, "".join(a))) for i, n, a in zip(ids, names, args, strict=True)]
    return ParsedMessage("".join(content) or None, "".join(reasoning) or None, calls)
