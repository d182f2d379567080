"""Anthropic's Messages API request shape (``/v1/messages``, ``/v1/messages/count_tokens``),
and its conversion to the fields of the one internal chat request.

The bodies are validated here (unknown fields and block types are a 400 naming them, as on
the chat route); :func:`chat_fields` turns one into the fields of ``/v1/chat/completions``'
body, which the front end validates and runs as a chat request: the chat template, tool
planning and grammars, sampling checks, limits and output parsing are that route's.

Mapping: ``system`` (text or text blocks) is a system message; a user turn's ``tool_result``
blocks become ``tool`` messages (before the turn's text, as Anthropic orders them); an
assistant turn's ``tool_use`` blocks become its ``tool_calls`` (``input`` as JSON text);
``tools[].input_schema`` is a function's ``parameters``; ``tool_choice`` ``auto`` / ``any`` /
``tool`` / ``none`` is ``auto`` / ``required`` / the named function / ``none``;
``stop_sequences`` is ``stop``; ``output_config.format`` (a JSON schema) is ``response_format``.
``cache_control`` breakpoints (on blocks and tools, or at the top level for the whole
conversation) (:func:`breakpoints`) name a
prefix of the converted messages to pin for the breakpoint's TTL.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from radixserve.schema.base import (
    INT64_MAX,
    NAME_PATTERN,
    Body,
    RequestBody,
    check_json_schema,
    reject,
)

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache lifetimes


class CacheControl(Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # ignored: nothing here cites documents


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # ignored: fields of an answer's block that a client hands back with it
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ThinkingBlock(Body):
    """An earlier answer's reasoning, handed back: given to the chat template."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # ignored
    cache_control: CacheControl | None = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(
            b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise reject("name", "tool_choice.name is given with (and only with) type 'tool'")
        return self


class JSONOutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @model_validator(mode="after")
    def _schema(self) -> JSONOutputFormat:
        check_json_schema("output_config.format.schema", self.schema_, param="schema")
        return self


class OutputConfig(Body):
    effort: str | None = None  # ignored: a hint for Anthropic's models
    format: JSONOutputFormat | None = None


class ThinkingConfig(Body):
    """Extended thinking: with a reasoning parser the answer's reasoning is a ``thinking``
    block; ``disabled`` turns the template's thinking mode off (``enable_thinking``).
    ``budget_tokens`` is accepted and ignored (``max_tokens`` bounds the whole answer)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(None, ge=1)
    display: str | None = None  # ignored


class CountTokensRequest(RequestBody):
    """``/v1/messages/count_tokens``: what the prompt is made of."""

    model: str | None = None
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # Automatic caching: a breakpoint at the end of the conversation.
    cache_control: CacheControl | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    # radixserve's extension, as on the chat route: the cache namespace
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _tool_results_answer_calls(self) -> CountTokensRequest:
        """Every ``tool_result`` answers a ``tool_use`` of an earlier assistant turn."""
        called: set[str] = set()
        for i, msg in enumerate(self.messages):
            for j, block in enumerate(msg.blocks()):
                where = f"messages[{i}].content[{j}]"
                if isinstance(block, ToolUseBlock | ThinkingBlock) and msg.role != "assistant":
                    raise reject(f"{where}.type", f"{where}: {block.type} blocks belong to "
                                                  "assistant turns")
                if isinstance(block, ToolUseBlock):
                    called.add(block.id)
                elif isinstance(block, ToolResultBlock):
                    if msg.role != "user":
                        raise reject(f"{where}.type", f"{where}: tool_result blocks belong to "
                                                      "user turns")
                    if block.tool_use_id not in called:
                        raise reject(f"{where}.tool_use_id",
                                     f"{where}.tool_use_id {block.tool_use_id!r} answers no "
                                     "tool_use block of an earlier assistant turn")
        return self


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``."""

    max_tokens: StrictInt = Field(..., ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    # Accepted and ignored: they change nothing a client relies on here.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(b.text for b in system)


def _turn(msg: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages."""
    blocks = msg.blocks()
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if msg.role == "assistant":
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        out: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            out["tool_calls"] = calls
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            out["reasoning_content"] = thinking
        return [out]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in blocks if isinstance(b, ToolResultBlock)]
    has_text = any(isinstance(b, TextBlock) for b in blocks)
    return results + ([{"role": "user", "content": text}] if has_text or not results else [])


def chat_messages(body: CountTokensRequest) -> tuple[list[dict[str, Any]], list[int]]:
    """The chat messages, and for each Anthropic turn the number of chat messages that end
    with it."""
    system = _system_text(body.system)
    out: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    ends = []
    for msg in body.messages:
        out += _turn(msg)
        ends.append(len(out))
    return out, ends


def _tool_fields(body: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description else {})}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = {
            "auto": "auto", "any": "required", "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }[choice.type]
        if choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body fields equivalent to ``body``."""
    messages, _ = chat_messages(body)
    # the model may name a LoRA adapter
    fields: dict[str, Any] = {"messages": messages, "model": body.model, **_tool_fields(body)}
    if body.cache_salt is not None:
        fields["cache_salt"] = body.cache_salt
    if body.thinking is not None and body.thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    return {k: v for k, v in fields.items() if v is not None}


def breakpoints(body: CountTokensRequest) -> list[tuple[int, float]]:
    """The ``cache_control`` breakpoints as ``(chat messages, ttl seconds)``: the prefix a
    breakpoint pins is the rendered prompt of the first ``chat messages`` messages (a block's
    breakpoint covers the turn that holds it; one on a tool or in the system prompt covers
    the system prompt, or the first turn when there is none).  Longest TTL per prefix."""
    messages, ends = chat_messages(body)
    first = 1 if body.system is not None else ends[0]
    found: dict[int, float] = {}

    def mark(count: int, cc: CacheControl | None) -> None:
        if cc is not None:
            found[count] = max(found.get(count, 0.0), TTL_SECONDS[cc.ttl])

    for tool in body.tools or []:
        mark(first, tool.cache_control)
    for block in body.system if isinstance(body.system, list) else []:
        mark(first, block.cache_control)
    for msg, end in zip(body.messages, ends, strict=True):
        for block in msg.blocks():
            mark(end, block.cache_control)
    mark(len(messages), body.cache_control)
    return sorted(found.items())


# Chat field paths -> the Messages fields they were converted from (the first match applies;
# ``messages[i]...`` paths are :func:`field_names`').
FIELD_RENAMES = [
    (re.compile(r"^tools(\[\d+\])\.function\.parameters\b"), r"tools\1.input_schema"),
    (re.compile(r"^tools(\[\d+\])\.function\b"), r"tools\1"),
    (re.compile(r"^tool_choice\.function\b"), "tool_choice"),
    (re.compile(r"^response_format(\.json_schema)?\b"), "output_config.format"),
    (re.compile(r"^json_schema$"), "output_config.format"),  # its grammar
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"^parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
]
# What the converted tool_choice values were sent as.
CHOICE_NAMES = {"tool_choice 'required'": "tool_choice {'type': 'any'}",
                "tool_choice 'auto'": "tool_choice {'type': 'auto'}"}
_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_CALL = re.compile(r"^\.tool_calls\[(\d+)\](.*)$")
_CALL_FIELDS = {".function.arguments": ".input", ".function.name": ".name", ".id": ".id"}


def _turn_field(msg: Message, i: int, position: int, rest: str) -> str:
    """The field of Anthropic turn ``msg`` (``messages[i]``) that its ``position``-th chat
    message's field ``rest`` came from: a block where one block made it."""
    blocks = msg.blocks()
    if msg.role == "assistant":
        call = _CALL.match(rest)
        uses = [j for j, b in enumerate(blocks) if isinstance(b, ToolUseBlock)]
        if call and int(call[1]) < len(uses):
            return f"messages[{i}].content[{uses[int(call[1])]}]{_CALL_FIELDS.get(call[2], '')}"
        thinking = [j for j, b in enumerate(blocks) if isinstance(b, ThinkingBlock)]
        if rest == ".reasoning_content" and thinking:
            return f"messages[{i}].content[{thinking[0]}].thinking"
        return f"messages[{i}]{rest if rest == '.content' else ''}"
    results = [j for j, b in enumerate(blocks) if isinstance(b, ToolResultBlock)]
    if position < len(results):
        tail = {".content": ".content", ".tool_call_id": ".tool_use_id"}.get(rest, "")
        return f"messages[{i}].content[{results[position]}]{tail}"
    return f"messages[{i}]{rest if rest == '.content' else ''}"


def field_names(body: CountTokensRequest) -> Callable[[str], str | None]:
    """The Messages field a chat message's field path (``messages[k]...``) of
    ``chat_fields(body)`` came from (None for other paths: see ``FIELD_RENAMES``)."""
    _, ends = chat_messages(body)
    system = int(body.system is not None)

    def rename(path: str) -> str | None:
        m = _MESSAGE.match(path)
        if m:
            k = int(m[1])
            if k < system:
                return "system"
            i = next(t for t, end in enumerate(ends) if k < end)
            start = ends[i - 1] if i else system
            return _turn_field(body.messages[i], i, k - start, m[2])
        return None

    return rename
