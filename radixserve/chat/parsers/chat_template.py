"""Chat-template handling for tools: which format a template speaks, and the messages it gets.

Templates that render ``tools`` natively (Hermes/Qwen, Llama 3.x, Mistral) receive the tools
and the tool-call history as they expect.  For a template that ignores ``tools`` (the default
model's), radixserve uses its own *prompted* format:

    The tools are described in a system message (appended to the first system message after a
    blank line, or prepended as a new one): a header, then one line per tool holding
    ``{"type": "function", "function": {...}}`` as JSON with sorted keys inside
    ``<tools></tools>``, then the instruction to answer with
    ``<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>``
    blocks.  Earlier assistant tool calls are rendered as those same blocks (the arguments
    text verbatim, after the message's content and a newline), and each run of ``tool``
    messages becomes one user message of ``<tool_response>\\n<content>\\n</tool_response>``
    blocks, one per result, joined by newlines.

The rendering is a pure function of the request, so the same tools and history give the same
prompt tokens and the radix cache serves them turn after turn.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

_PROBE_TOOL = {"type": "function", "function": {
    "name": "radixserve_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}},
}}

PROMPTED_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


def prompted_tools_text(tools: list[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` in the prompted format (deterministic)."""
    lines = "\n".join(json.dumps(t, sort_keys=True, ensure_ascii=False) for t in tools)
    return PROMPTED_INSTRUCTIONS.format(tools=lines)


def tool_call_text(name: str, arguments: str) -> str:
    """One call as the hermes/prompted format writes it (``arguments`` is JSON text)."""
    return (
        f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
        f'"arguments": {arguments}}}\n</tool_call>'
    )


def _prompted_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = [tool_call_text(tc["function"]["name"], tc["function"]["arguments"])
                 for tc in (m.get("tool_calls") or [])]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m["role"] == "assistant" and calls:
            m["content"] = (m["content"] + "\n" if m["content"] else "") + "\n".join(calls)
        out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out


def prompted_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system message, tool calls
    and results as text.  ``tools`` empty: no tool description (tool_choice "none")."""
    out = _prompted_history(messages)
    if tools:
        text = prompted_tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {
                **out[0],
                "content": (out[0]["content"] + "\n\n" if out[0]["content"] else "") + text,
            }
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tool calls: arguments as objects (the templates
    serialize them with ``tojson``)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                args: Any = tc["function"]["arguments"]
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass  # the template gets the text as the client sent it
                calls.append({**tc, "function": {**tc["function"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows ``tools`` to the model (renders a dummy tool's name)."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL],
            add_generation_prompt=True, tokenize=False,
        )
    except Exception as e:  # a template that cannot take tools does not render them
        logger.info("the chat template fails with tools (%s); using the prompted tool format", e)
        return False
    return _PROBE_TOOL["function"]["name"] in text


def detect_tool_parser(tokenizer: Any) -> str:
    """The ``--tool-call-parser`` value for this tokenizer's chat template ("auto")."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "prompted"
    text = json.dumps(template) if isinstance(template, dict) else str(template)
    if not template_renders_tools(tokenizer):
        return "prompted"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3"
    logger.warning(
        "the chat template renders tools in an unknown format; parsing hermes tool calls"
    )
    return "hermes"
