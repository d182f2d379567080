"""One choice's output parser: reasoning split first, then tool calls in the content."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.chat.parsers.base import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallStart,
    assemble,
    new_call_id,
)
from radixserve.chat.parsers.reasoning import ReasoningStream
from radixserve.chat.parsers.tool_formats import ToolFormat
from radixserve.chat.parsers.tool_stream import ToolCallStream


@dataclass(frozen=True)
class ParseSpec:
    """How a request's outputs are parsed (one parser per choice is made from it)."""

    tool_format: ToolFormat | None = None  # None: no tool parsing
    tool_names: frozenset[str] | None = None  # calls of other names are content
    max_calls: int | None = None  # 1 with parallel_tool_calls=false
    reasoning_parser: str | None = None  # None: no reasoning split
    prompt_opened: bool = False  # the prompt ends inside <think>
    thinking: bool = True  # chat_template_kwargs enable_thinking

    @property
    def active(self) -> bool:
        return self.tool_format is not None or self.reasoning_parser is not None

    def new_parser(self, new_id: Callable[[], str] = new_call_id) -> OutputParser:
        reasoning = (ReasoningStream(self.reasoning_parser, prompt_opened=self.prompt_opened,
                                     thinking=self.thinking) if self.reasoning_parser else None)
        tools = (ToolCallStream(self.tool_format, self.tool_names, self.max_calls, new_id)
                 if self.tool_format else None)
        return OutputParser(reasoning, tools)


class OutputParser:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def _route(self, pieces: list[Delta]) -> list[Delta]:
        if self.tools is None:
            return pieces
        out: list[Delta] = []
        for p in pieces:
            out += self.tools.feed(p.text) if isinstance(p, ContentDelta) else [p]
        return out

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        return self._route(self.reasoning.feed(text) if self.reasoning else [ContentDelta(text)])

    def finish(self) -> list[Delta]:
        out = self._route(self.reasoning.finish()) if self.reasoning else []
        return out + (self.tools.finish() if self.tools else [])

    def parse(self, text: str) -> ParsedMessage:
        """Non-streaming: the whole output at once."""
        return assemble(self.feed(text) + self.finish())


def openai_deltas(pieces: list[Delta]) -> list[dict[str, Any]]:
    """Chat-completion-chunk ``delta`` objects for pieces (content, reasoning_content, or one
    ``tool_calls`` entry each)."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if isinstance(p, ContentDelta):
            out.append({"content": p.text})
        elif isinstance(p, ReasoningDelta):
            out.append({"reasoning_content": p.text})
        elif isinstance(p, ToolCallStart | ToolArgsDelta):
            out.append({"tool_calls": [p.to_openai()]})
    return out
