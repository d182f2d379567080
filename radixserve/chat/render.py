"""Chat messages to prompt text: the one rendering shared by ``/v1/chat/completions``,
``/apply_chat_template`` and ``Engine.apply_chat_template``.

The same messages, template options and (no) tools give the same text on every path, so a
prompt rendered by ``/apply_chat_template`` and generated from with ``/generate`` hits the
prefix the chat route cached, and the other way round.  No HTTP here: errors are
:class:`ChatTemplateError`, a ``ValueError`` naming the request field at fault.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from pydantic import ValidationError

from radixserve.chat.messages import ChatMessage
from radixserve.chat.parsers import detect_tool_parser, native_messages, prompted_messages

_ROLES = {"developer": "system", "function": "tool"}


class ChatTemplateError(ValueError):
    """The messages or template options cannot be rendered; ``param`` is the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@functools.lru_cache(maxsize=8)
def _detected_parser(tokenizer: Any) -> str:
    return detect_tool_parser(tokenizer)


def tool_parser(tokenizer: Any, setting: str) -> str:
    """The tool-call format in use: the ``--tool-call-parser`` setting, or the detected one."""
    return _detected_parser(tokenizer) if setting == "auto" else setting


def template_kwargs(tokenizer: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs``: extra template variables; apply_chat_template's own
    parameters (tools, tokenize, ...) are set by the server and refused here."""
    kwargs = dict(given or {})
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    clash = sorted(own & set(kwargs))
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: the server sets them",
                                "chat_template_kwargs")
    return kwargs


def render_chat(tokenizer: Any, messages: list[ChatMessage], *, parser: str,
                add_generation_prompt: bool, continue_final_message: bool,
                kwargs: dict[str, Any], offered: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for ``messages`` (validated :class:`ChatMessage`) with the chat
    template; ``offered`` are the tools shown to the model (none: a request without tools),
    in the tool-call format ``parser`` (``"prompted"``: radixserve's own, in the messages)."""
    msgs = []
    for m in messages:
        d: dict[str, Any] = {"role": _ROLES.get(m.role, m.role), "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [tc.model_dump(exclude={"index"}) for tc in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:  # templates that show earlier reasoning read it
            d["reasoning_content"] = m.reasoning_content
        msgs.append(d)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions (or "
                                "/generate) with a prompt", "messages")
    if parser == "prompted":
        msgs, tools = prompted_messages(msgs, offered or []), None
    else:
        msgs, tools = native_messages(msgs), offered or None
    try:
        return tokenizer.apply_chat_template(
            msgs,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # template errors (jinja) are the request's fault
        raise ChatTemplateError(
            f"cannot apply the chat template to these messages: {e}", "messages"
        ) from e


def render_without_tools(tokenizer: Any, parser_setting: str, body: Any) -> str:
    """The prompt of an ``ApplyChatTemplateRequest`` (``body``): what the chat route renders
    for the same messages and options without tools."""
    return render_chat(
        tokenizer, body.messages, parser=tool_parser(tokenizer, parser_setting),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        kwargs=template_kwargs(tokenizer, body.chat_template_kwargs),
    )


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_message(e: ValidationError) -> str:
    """A pydantic error as one line naming the field (for Python callers' ``ValueError``);
    union branch names in pydantic's location (``str``, ``list[ContentPart]``) are left out."""
    err = e.errors()[0]
    where = ""
    for part in err["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif not (part[:1].isupper() or "[" in part or part in _BRANCHES):
            where += f".{part}" if where else part
    return f"{where}: {err['msg']}" if where else err["msg"]
