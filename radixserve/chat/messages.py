"""Chat messages: content parts, tool calls, and the deprecated ``functions`` entries; and the
body of ``/apply_chat_template`` (``Engine.apply_chat_template`` validates with it too)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, field_validator, model_validator

from radixserve.schema.base import NAME_PATTERN, Body, RequestBody, reject, unsupported

_MEDIA_PARTS = ("image_url", "input_audio", "file", "video_url", "audio_url")


class ContentPart(Body):
    """A text part, or (assistant messages only) a refusal part."""

    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # ignored

    @model_validator(mode="after")
    def _payload(self) -> ContentPart:
        if (
            (self.text is None) != (self.type == "refusal")
            or (self.refusal is None) != (self.type == "text")
        ):
            raise reject(
                self.type, f"a {self.type} part needs '{self.type}' (a string) and no other payload"
            )
        return self

    @property
    def content(self) -> str:
        return self.text if self.type == "text" else self.refusal  # type: ignore[return-value]


class ToolCallFunction(Body):
    name: str
    arguments: str = "{}"  # SGLang's router sends null for a call without arguments


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None  # SGLang's schema has it (a streamed call's index); ignored


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # assistant only
    function_call: ToolCallFunction | None = None  # deprecated; becomes tool_calls
    audio: Any = None  # UNSUPPORTED
    # SGLang: an earlier answer's reasoning, given to the chat template (assistant only).
    reasoning_content: str | None = None
    tools: list[dict[str, Any]] | None = None  # SGLang: tools given in a message; refused when set

    @field_validator("content", mode="before")
    @classmethod
    def _no_media(cls, v: Any) -> Any:
        for j, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise reject(f"[{j}]", f"{kind} content parts are not supported: radixserve "
                                       "serves text-only models")
        return v

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.audio is not None:
            raise unsupported("messages[].audio", param="audio")
        if self.tools:
            raise unsupported("messages[].tools", param="tools")
        if self.role != "assistant":
            extra = [k for k in ("refusal", "function_call", "tool_calls", "reasoning_content")
                     if getattr(self, k) is not None]
            if extra:
                raise reject(extra[0], f"'{extra[0]}' is only valid in assistant messages")
            if isinstance(self.content, list) and any(p.type == "refusal" for p in self.content):
                raise reject("content", "refusal parts are only valid in assistant messages")
        if self.role == "function" and not self.name:
            raise reject("name", "a function message needs the function's name")
        if self.function_call is not None:
            if self.tool_calls:
                raise reject(
                    "function_call", "give tool_calls or the deprecated function_call, not both"
                )
            self.tool_calls = [
                ToolCall(id=f"call_{self.function_call.name}", function=self.function_call)
            ]
        if self.content is None and not (
            self.tool_calls or self.refusal or self.role == "function"
        ):
            raise reject("content", f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.content for p in self.content)
        return self.content if self.content is not None else (self.refusal or "")


class FunctionDef(Body):
    """An entry of the deprecated ``functions`` list."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionName(Body):
    name: str


class Prediction(Body):
    type: Literal["content"]
    content: str | list[ContentPart]


def check_continue_final(body: Any) -> None:
    """``continue_final_message`` continues the last (assistant) message; the default
    ``add_generation_prompt`` yields to it, an explicit true conflicts."""
    if body.continue_final_message:
        if body.messages[-1].role != "assistant":
            raise reject("continue_final_message", "continue_final_message needs the last "
                                                   "message to be an assistant message")
        if "add_generation_prompt" in body.model_fields_set and body.add_generation_prompt:
            raise reject("continue_final_message", "continue_final_message and "
                                                   "add_generation_prompt cannot both be true")


class ApplyChatTemplateRequest(RequestBody):
    """``/apply_chat_template``: chat messages to the prompt text the chat route would render
    for them without tools."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ApplyChatTemplateRequest:
        check_continue_final(self)
        return self
