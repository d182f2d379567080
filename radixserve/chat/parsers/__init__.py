"""Output parsers (tool calls, reasoning) and chat-template handling for tools.

Public entry points used by the chat route:

- :func:`plan_tools` validates ``tools`` / ``tool_choice`` / ``parallel_tool_calls``;
- :func:`detect_tool_parser`, :func:`tool_format` pick the tool-call format;
- :func:`prompted_messages`, :func:`native_messages` prepare messages for the template;
- :func:`tool_call_grammar` builds the grammar enforcing "required" / a named function;
- :class:`ParseSpec` makes one :class:`OutputParser` per choice (streaming or not), and
  :func:`openai_deltas` turns its pieces into chat-completion-chunk deltas.
"""

from __future__ import annotations

from radixserve.chat.parsers.base import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallParsed,
    ToolCallStart,
    assemble,
    new_call_id,
)
from radixserve.chat.parsers.chat_template import (
    detect_tool_parser,
    native_messages,
    prompted_messages,
    prompted_tools_text,
    template_renders_tools,
    tool_call_text,
)
from radixserve.chat.parsers.output import OutputParser, ParseSpec, openai_deltas
from radixserve.chat.parsers.reasoning import (
    ReasoningStream,
    prompt_opens_reasoning,
    split_reasoning,
)
from radixserve.chat.parsers.tool_formats import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ToolFormat,
    tool_format,
)
from radixserve.chat.parsers.tool_grammar import tool_call_grammar
from radixserve.chat.parsers.tool_request import ToolPlan, ToolRequestError, plan_tools
from radixserve.chat.parsers.tool_stream import ToolCallStream, parse_tool_calls

__all__ = [
    "HERMES", "LLAMA3", "MISTRAL", "ContentDelta", "OutputParser", "ParseSpec", "ParsedMessage",
    "Delta", "ReasoningDelta", "ReasoningStream", "ToolArgsDelta", "ToolCallParsed",
    "ToolCallStart", "ToolCallStream", "ToolFormat", "ToolPlan", "ToolRequestError", "assemble",
    "detect_tool_parser", "native_messages", "new_call_id", "openai_deltas", "parse_tool_calls",
    "plan_tools", "prompt_opens_reasoning", "prompted_messages", "prompted_tools_text",
    "split_reasoning", "template_renders_tools", "tool_call_grammar", "tool_call_text",
    "tool_format",
]
