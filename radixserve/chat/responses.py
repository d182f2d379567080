"""OpenAI's Responses API request shape (``POST /v1/responses``), and its conversion to the
fields of the one internal chat request.

``input`` is text (one user message) or a list of items: messages (``input_text`` /
``output_text`` parts), ``function_call`` (an earlier answer's call) and
``function_call_output`` (its result); ``instructions`` is a system message placed before
the conversation (never carried over from a previous response, as in OpenAI's API).  Function
``tools``, ``tool_choice``, ``text.format`` (``json_schema`` / ``json_object``),
``max_output_tokens``, ``temperature`` and ``top_p`` map onto the chat body's fields; the front
end validates the result as a ``/v1/chat/completions`` body and runs it as one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from radixserve.schema.base import INT64_MAX, NAME_PATTERN, Body, RequestBody, reject


class TextPart(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # ignored (an answer's part handed back)
    logprobs: list[Any] | None = None  # ignored


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None  # an answer's item handed back: ignored
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """An earlier answer's reasoning, handed back: given to the chat template with the
    assistant message that follows it (templates that show earlier reasoning read it)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []
    id: str | None = None
    status: str | None = None
    encrypted_content: str | None = None  # ignored: nothing here encrypts reasoning

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
Item = Annotated[InputItem, Field(discriminator="type")]


def _item_type(value: Any) -> Any:
    """A message item may leave out ``type`` (OpenAI's "easy input message")."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # the schema is always enforced in full


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None  # not shown to the model
    strict: StrictBool | None = None  # always enforced in full

    @model_validator(mode="after")
    def _schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise reject("schema", "text.format of type json_schema needs a schema")
        return self


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # ignored: a hint for OpenAI's models


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = Field(None, min_length=1)
    # radixserve's extension, as on the chat route: the cache (and response store) namespace
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # Accepted and ignored: they change nothing a client relies on here.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: Literal[False] | None = None  # background mode is not offered

    @model_validator(mode="before")
    @classmethod
    def _message_types(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [_item_type(x) for x in data["input"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input:
            raise reject("input", "input must not be empty")
        return self

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def conversation(items: list[InputItem], earlier: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], list[tuple[int, ...]]]:
    """Chat messages of ``earlier`` (a stored conversation's) followed by ``items``, and for
    each message the indices of the items it holds (none for ``earlier``'s): runs of function
    calls join one assistant message; a reasoning item goes with the assistant message after
    it; a call's output is a ``tool`` message and must answer a call made before it
    (ValueError naming the item otherwise)."""
    out = [dict(m) for m in earlier]
    origins: list[tuple[int, ...]] = [()] * len(out)
    called = {c["id"] for m in earlier for c in m.get("tool_calls") or ()}
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
            continue
        if isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
            raise ValueError(f"input[{i}].call_id {item.call_id!r} answers no function_call "
                             "of this conversation")
        if isinstance(item, FunctionCallItem):
            called.add(item.call_id)
        msg = _message(item)
        last = out[-1] if out else None
        if (isinstance(item, FunctionCallItem) and last is not None and reasoning is None
                and last["role"] == "assistant" and "tool_calls" in last):
            last["tool_calls"] = [*last["tool_calls"], *msg["tool_calls"]]
            origins[-1] += (i,)
            continue
        if msg["role"] == "assistant" and reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        out.append(msg)
        origins.append((i,))
    return out, origins


def _message(item: MessageItem | FunctionCallItem | FunctionCallOutputItem) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        return {"role": item.role, "content": item.text()}
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "tool", "tool_call_id": item.call_id, "content": item.output}


def chat_fields(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body fields for ``body`` whose conversation (previous
    turns included) is ``messages``."""
    system = [] if body.instructions is None else [
        {"role": "system", "content": body.instructions}]
    fields: dict[str, Any] = {
        "messages": system + messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls, "cache_salt": body.cache_salt,
        "model": body.model,  # may name a LoRA adapter
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(
            include={"name", "description", "parameters"}, exclude_none=True)}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    # ``text.format`` shapes the answer's message text; a call that ``tool_choice`` forces
    # (``required`` or a named function) leaves no text to shape, and the chat route refuses
    # two constraints at once, so it applies only when the model may answer in text (as in
    # OpenAI's API, where an agent's structured output type comes with any tool choice).
    forced = choice is not None and choice not in ("auto", "none")
    if fmt is not None and fmt.type != "text" and not forced:
        fields["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    return {k: v for k, v in fields.items() if v is not None}


def assistant_message(text: str, calls: list[tuple[str, str, str]],
                      reasoning: str | None = None) -> dict[str, Any]:
    """An answer as the chat message the next turn's conversation holds: its text, its
    calls as ``(call_id, name, arguments)`` and its reasoning."""
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [{"id": cid, "type": "function",
                              "function": {"name": name, "arguments": args}}
                             for cid, name, args in calls]
    return msg


# Chat field paths -> the Responses fields they were converted from (the first match applies;
# ``messages[i]...`` paths are :func:`field_names`').
FIELD_RENAMES = [(re.compile(r"^messages$"), "input"),
                 (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
                 (re.compile(r"^tools(\[\d+\])\.function\b"), r"tools\1"),
                 (re.compile(r"^tool_choice\.function\b"), "tool_choice"),
                 (re.compile(r"^response_format(\.json_schema)?\b"), "text.format")]
_MESSAGE = re.compile(r"^messages\[(\d+)\](.*)$")
_CALL = re.compile(r"^\.tool_calls\[(\d+)\](.*)$")
_CALL_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id"}
_OUTPUT_FIELDS = {".content": ".output", ".tool_call_id": ".call_id"}


def field_names(body: ResponsesRequest, origins: list[tuple[int, ...]]
                ) -> Callable[[str], str | None]:
    """The Responses field a chat message's field path (``messages[k]...``) of
    ``chat_fields(body, messages)`` came from (None for other paths: see ``FIELD_RENAMES``);
    ``origins`` as :func:`conversation` returns them."""
    system = int(body.instructions is not None)
    items = body.items()

    def message(k: int, rest: str) -> str:
        if k < 0:
            return "instructions"
        if not origins[k]:
            return "previous_response_id"
        if isinstance(body.input, str):
            return "input"
        first = origins[k][0]
        call = _CALL.match(rest)
        if call:  # a function_call item of the run this message holds
            t = int(call[1])
            where = origins[k][t] if t < len(origins[k]) else first
            return f"input[{where}]{_CALL_FIELDS.get(call[2], '')}"
        if isinstance(items[first], FunctionCallOutputItem):
            return f"input[{first}]{_OUTPUT_FIELDS.get(rest, '')}"
        return f"input[{first}]{rest}"

    def rename(path: str) -> str | None:
        m = _MESSAGE.match(path)
        return message(int(m[1]) - system, m[2]) if m else None

    return rename


def size_of(value: Any) -> int:
    """Bytes a stored value takes as JSON (the response store's measure)."""
    return len(json.dumps(value, separators=(",", ":")))
